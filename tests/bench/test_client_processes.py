"""bench/client_processes.py: a round split among client processes comes back whole, in order,
each completion as one client gets it; the workers end with the target."""

from __future__ import annotations

from bench.client_processes import ProcessClients
from bench.generation_targets import SERVED_NAME, OpenAICompletions
from bench.launcher import start_gateway


async def test_a_round_from_three_processes_equals_it_from_one(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text(f'[[models]]\nname = "{SERVED_NAME}"\nmodel = "smollm2-135m"\nbackend = "mock"\n')
    gateway = start_gateway(["--config", str(config)], tmp_path / "gateway.log")
    one = OpenAICompletions(gateway.base_url, "gateway")
    several = ProcessClients(gateway.base_url, "gateway", 3)
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
        await one.client.close()
        gateway.stop()
    assert not any(worker.is_alive() for worker in several.workers)
