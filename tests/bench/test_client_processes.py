"""bench/client_processes.py: a round split among client processes comes back whole, in order,
each completion as one client gets it; the workers end with the target. bench/native_generate.py:
the same round through /generate comes back as through /v1/completions."""

from __future__ import annotations

from bench.client_processes import ProcessClients
from bench.generation_targets import SERVED_NAME, OpenAICompletions
from bench.launcher import start_gateway
from bench.native_generate import NativeGenerate


async def test_a_round_from_three_processes_equals_it_from_one(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text(f'[[models]]\nname = "{SERVED_NAME}"\nmodel = "smollm2-135m"\nbackend = "mock"\n')
    gateway = start_gateway(["--config", str(config)], tmp_path / "gateway.log")
    one = OpenAICompletions(gateway.base_url, "gateway")
    several = ProcessClients("completions", gateway.base_url, "gateway", 3)
    try:
        prompts = [f"Prompt number {i} says" for i in range(7)]  # more than the processes, unevenly
        alone = await one.round(prompts, 6, logprobs=1)
        split = await several.round(prompts, 6, logprobs=1)
        assert [c.text for c in split] == [c.text for c in alone]
        assert [c.token_logprobs for c in split] == [c.token_logprobs for c in alone]
        assert all(c.tokens == 6 for c in split) and len({c.text for c in split}) > 1
        assert [c.text for c in await several.round(prompts[:2], 6, logprobs=None)] == [
            c.text for c in alone[:2]
        ]  # fewer requests than processes
    finally:
        several.close()
        await one.close()
        gateway.stop()
    assert not any(worker.is_alive() for worker in several.workers)


async def test_a_round_through_generate_equals_it_through_completions(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text(f'[[models]]\nname = "{SERVED_NAME}"\nmodel = "smollm2-135m"\nbackend = "mock"\n')
    gateway = start_gateway(["--config", str(config)], tmp_path / "gateway.log")
    completions = OpenAICompletions(gateway.base_url, "gateway")
    generate = NativeGenerate(gateway.base_url)
    several = ProcessClients("generate", gateway.base_url, "gateway", 2)
    try:
        prompts = [f"Prompt number {i} says" for i in range(5)]
        expected = await completions.round(prompts, 6, logprobs=1)
        for way in (generate, several):
            got = await way.round(prompts, 6, logprobs=1)
            assert [c.text for c in got] == [c.text for c in expected]
            assert [c.tokens for c in got] == [c.tokens for c in expected] == [6] * 5
            assert [c.token_logprobs for c in got] == [c.token_logprobs for c in expected]
        bare = await generate.round(prompts[:2], 6, logprobs=None)
        assert [c.text for c in bare] == [c.text for c in expected[:2]] and bare[0].token_logprobs == []
        assert not several.takes_grammars
    finally:
        several.close()
        await generate.close()
        await completions.close()
        gateway.stop()
