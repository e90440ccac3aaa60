"""How the SGLang engine starts SGLang: a managed `sglang.launch_server` child ("server" mode) or
`sglang.Engine` in this process ("engine" mode), each with the settings the engine relies on
(backends/sglang/engine.py says why each is needed)."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from backends.errors import EngineUnavailableError
from backends.sglang.transport import EngineTransport, HttpTransport, ManagedServer, free_port
from backends.types import EngineConfig

log = logging.getLogger(__name__)

# Sampled-token logprobs before temperature (the module docstring of backends/sglang/engine.py).
RAW_LOGPROBS = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def tp_size(mode: str, options: dict[str, Any]) -> int:
    """SGLang's tensor-parallel ranks, each sent its own handles of tensors handed over: the
    `tp_size` option ("engine": a ServerArgs field; "url": what the server runs), or the "server"
    mode's `--tp-size`."""
    if mode == "server":
        args = [str(arg) for arg in options.get("launch_args", [])]
        for flag in ("--tp-size", "--tp"):
            if flag in args[:-1]:
                return int(args[args.index(flag) + 1])
        return 1
    return int(options.get("tp_size", 1) if mode == "engine" else options.pop("tp_size", 1))


def launch_server(config: EngineConfig, path: Path, options: dict[str, Any], http: dict) -> HttpTransport:
    command = list(options.get("server_command") or [sys.executable, "-m", "sglang.launch_server"])
    command += ["--model-path", str(path), "--dtype", config.dtype, "--skip-server-warmup"]
    # Dense rows through backends/sglang/processor.py; streamed chunks with the new tokens only,
    # not every token so far (which makes a stream's JSON quadratic in its length).
    command += ["--enable-custom-logit-processor", "--incremental-streaming-output"]
    if config.max_model_len:
        command += ["--context-length", str(config.max_model_len)]
    if config.max_lora_rank:
        command += ["--enable-lora", "--max-lora-rank", str(config.max_lora_rank)]
        command += ["--lora-target-modules", "all"]
    launch_args = [str(arg) for arg in options.get("launch_args", [])]
    if "--grammar-backend" not in launch_args:
        command += ["--grammar-backend", "llguidance", "--constrained-json-disable-any-whitespace"]
    command += launch_args
    log_path = Path(options.get("log_path") or tempfile.mkstemp(prefix="sglang-", suffix=".log")[1])
    log.info("launching %s (log: %s)", " ".join(command), log_path)
    server = ManagedServer(command, free_port(), log_path, env=RAW_LOGPROBS)
    server.wait_healthy(float(options.get("startup_timeout_s", 900.0)))
    transport = HttpTransport(server.base_url, **http)
    transport.server = server
    return transport


def start_in_process(config: EngineConfig, path: Path, options: dict[str, Any]) -> EngineTransport:
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailableError("sglang mode 'engine' needs CUDA; use mode 'server' or 'url'")
    os.environ.update(RAW_LOGPROBS)  # read when SGLang's sampler module is imported
    args: dict[str, Any] = {
        "model_path": str(path),
        "dtype": config.dtype,
        "enable_custom_logit_processor": True,
        "grammar_backend": options.pop("grammar_backend", "llguidance"),
        "constrained_json_disable_any_whitespace": options.pop(
            "constrained_json_disable_any_whitespace", True
        ),
    }
    if config.max_model_len:
        args["context_length"] = config.max_model_len
    if config.max_lora_rank:
        args.update(enable_lora=True, max_lora_rank=config.max_lora_rank, lora_target_modules=["all"])
    for key in ("server_command", "launch_args", "startup_timeout_s", "log_path"):
        options.pop(key, None)
    return EngineTransport.start(**args, **options)
