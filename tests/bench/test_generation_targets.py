"""bench/generation_targets.py's gateway configs: `--engine-option` values reach every gateway
target's model options, over the target's own."""

from __future__ import annotations

import tomllib

from bench.generation_targets import Setup, gateway_toml


def test_engine_options_reach_the_gateway_config(tmp_path):
    setup = Setup(
        tmp_path / "model",
        "float32",
        "cpu",
        tmp_path,
        logs_kept=False,
        engine_options={"greedy_steps_ahead": 32, "dense_rows": "capture"},
    )
    plain = tomllib.loads(gateway_toml("gateway-transformers", setup).read_text())["models"][0]
    assert plain["backend"] == "transformers"
    assert plain["options"] == {"greedy_steps_ahead": 32, "dense_rows": "capture"}
    vllm = tomllib.loads(gateway_toml("gateway-vllm-logprobs", setup).read_text())["models"][0]
    assert vllm["options"]["dense_rows"] == "capture"  # the option given wins over the target's own
    bare = Setup(tmp_path / "model", "float32", "cpu", tmp_path, logs_kept=False)
    assert tomllib.loads(gateway_toml("gateway-transformers", bare).read_text())["models"][0]["options"] == {}
