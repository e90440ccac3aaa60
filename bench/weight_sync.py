"""An RL trainer's weight sync into the gateway over NCCL, with TorchRL unchanged: time per sync
beside the collective's own broadcast of the same tensors, rows after each sync against the
trainer's forward pass, and a generation held across a sync and resumed.

    python -m bench.weight_sync --random-model llama-1b --tokenizer DIR --dtype bfloat16 --syncs 5

Needs two GPUs. The trainer is this process on --trainer-gpu, with TorchRL's
`SGLangWeightSyncScheme` as its docs use it (strategy `state_dict`: the `tensordict` strategy
nests a Hugging Face model's names, which `send_weights` then cannot find). The gateway serves
the same weights on --gateway-gpu (its CUDA_VISIBLE_DEVICES), in this process's environment
otherwise, changed by --gateway-env. TorchRL sets NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 in the
trainer; the gateway sets the same in itself where its environment leaves them unset (NCCL picks a
transport per rank from that rank's environment).

Each sync adds noise to every weight, then `sender.update_weights()`: pause, poll /get_load,
announce and broadcast every tensor, continue; each phase is timed. Before each sync a greedy
stream is started and the sync waits for its first tokens: its tokens are counted before the
pause, between the pause and the continue (held: none expected) and after. The reference: a
plain process on the gateway's GPU, with the gateway's NCCL settings, that forms the same kind of
group (TorchRL's `_init_custom_process_group`) and receives the same tensors in the same order
into buffers allocated once, --syncs times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from backends.builtin_models import resolve_model_dir
from backends.transformers.weights_collective import DTYPES, TRAINER_NCCL_ENV
from bench.launcher import free_port, start_gateway
from bench.smc import add_model_arguments, random_model_dir
from logprob_gateway_client import AsyncGatewayLM


def receive(args: argparse.Namespace) -> None:
    """The reference receiver: the announced tensors, --syncs times, over a group formed as the
    gateway forms it."""
    from torchrl.weight_update.llm.sglang_nccl import _init_custom_process_group

    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
    announced = json.loads(Path(args.announced).read_text())
    buffers = [torch.empty(shape, dtype=DTYPES[dtype], device=args.device) for _, dtype, shape in announced]
    group = _init_custom_process_group(
        backend="nccl" if on_gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        world_size=2,
        rank=1,
        group_name=args.group,
    )
    for _ in range(args.syncs):
        for buffer in buffers:
            torch.distributed.broadcast(buffer, src=0, group=group)
        if on_gpu:
            torch.cuda.synchronize()
    torch.distributed.destroy_process_group(group)


def broadcast_alone(
    weights: dict[str, torch.Tensor], env: dict[str, str], syncs: int, tmp: Path, device: str
) -> list[float]:
    """Seconds of each of `syncs` broadcasts of `weights` to the reference receiver."""
    from torchrl.weight_update.llm.sglang_nccl import _init_custom_process_group

    announced = tmp / "announced.json"
    announced.write_text(
        json.dumps([[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in weights.items()])
    )
    port, name = free_port(), f"reference_{uuid.uuid4().hex[:8]}"
    receiver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.weight_sync",
            "--device",
            device,
            "receive",
            "--port",
            str(port),
            "--group",
            name,
            "--announced",
            str(announced),
            "--syncs",
            str(syncs),
        ],
        env=env,
    )
    try:
        group = _init_custom_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=2,
            rank=0,
            group_name=name,
        )
        seconds = []
        for _ in range(syncs):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for tensor in weights.values():
                torch.distributed.broadcast(tensor, src=0, group=group)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        torch.distributed.destroy_process_group(group)
        receiver.wait(timeout=120)
        return seconds
    finally:
        if receiver.poll() is None:
            receiver.kill()


class Phases:
    """Wall-clock marks of TorchRL's pause and continue steps around each update."""

    def __init__(self, transport: Any) -> None:
        self.marks: list[tuple[str, float, float]] = []
        for step in ("_pause_generation_for_update", "_continue_generation_after_update"):
            setattr(transport, step, self._timed(step, getattr(transport, step)))

    def _timed(self, step: str, call: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                self.marks.append((step, started, time.perf_counter()))

        return timed

    def last(self) -> dict[str, float]:
        (_, pause_start, pause_end), (_, continue_start, continue_end) = self.marks[-2:]
        return {
            "pause": pause_end - pause_start,
            "update": continue_start - pause_end,
            "continue": continue_end - continue_start,
            "total": continue_end - pause_start,
            "paused_at": pause_end,
            "continued_at": continue_start,
        }


def stream(url: str, max_tokens: int, chunks: list[tuple[float, dict[str, Any]]]) -> None:
    """A greedy generation on SGLang's /generate, each chunk kept with its arrival time."""
    body = {
        "text": "Once upon a time",
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as answer:
        for line in answer.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunks.append((time.perf_counter(), json.loads(line[5:])))


def trainer_rows(policy: torch.nn.Module, rows: list[list[int]]) -> torch.Tensor:
    device = next(policy.parameters()).device
    with torch.no_grad():
        return torch.stack(
            [
                policy(torch.tensor([r], device=device)).logits[0, -1].float().log_softmax(-1).cpu()
                for r in rows
            ]
        )


def max_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(a) & torch.isfinite(b)
    return float((a - b).abs()[finite].max())


def run(args: argparse.Namespace) -> None:
    from torchrl.weight_update.llm import SGLangWeightSyncScheme
    from torchrl.weight_update.llm.sglang_nccl import get_model_metadata
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    gateway_env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(args.gateway_gpu)}
    gateway_env.update(kv.split("=", 1) for kv in args.gateway_env)
    gateway_env = {k: v for k, v in gateway_env.items() if v != ""}  # KEY= unsets
    dtype = getattr(torch, args.dtype)
    on_gpu = args.device == "cuda"
    device = torch.device(f"cuda:{args.trainer_gpu}" if on_gpu else "cpu")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        model_dir = (
            random_model_dir(args.random_model, dtype, device, tmp / "model", args.tokenizer)
            if args.random_model
            else resolve_model_dir(args.model)
        )
        config = tmp / "gateway.toml"
        config.write_text(
            f"trusted_weight_sync = true\nweight_sync_timeout_s = {args.timeout_s}\n"
            f'[[models]]\nname = "policy"\nmodel = "{model_dir}"\ndtype = "{args.dtype}"\ndevice = "{device.type}"\n'
        )
        gateway = start_gateway(["--config", str(config)], tmp / "gateway.log", env=gateway_env)
        stack.callback(gateway.stop)
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        vocab = policy.config.vocab_size
        lm = stack.enter_context(AsyncGatewayLM(gateway.base_url, "policy"))

        scheme = SGLangWeightSyncScheme(
            server_url=gateway.base_url,
            master_address="127.0.0.1",
            num_gpus=1,
            strategy="state_dict",
            device=args.trainer_gpu,
        )
        sender = scheme.create_sender()
        sender.register_model(policy)
        started = time.perf_counter()
        sender.init_all_workers_group(get_model_metadata(policy))
        print(
            f"group formed in {time.perf_counter() - started:.2f} s (trainer GPU {args.trainer_gpu}, "
            f"gateway GPU {args.gateway_gpu}); gateway NCCL env: "
            + ", ".join(f"{k}={gateway_env.get(k, '-')}" for k in TRAINER_NCCL_ENV),
            flush=True,
        )
        phases = Phases(sender._transport)

        lines = []
        for sync in range(1, args.syncs + 1):
            rows = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(8, 64, args.rows)]
            before = trainer_rows(policy, rows)
            with torch.no_grad():
                for parameter in policy.parameters():
                    parameter.add_(torch.randn_like(parameter), alpha=args.noise)
            chunks: list[tuple[float, dict[str, Any]]] = []
            streamer = threading.Thread(target=stream, args=(gateway.base_url, args.stream_tokens, chunks))
            streamer.start()
            while len(chunks) < 8 and streamer.is_alive():
                time.sleep(0.001)
            sender.update_weights()
            timing = phases.last()
            streamer.join(timeout=600)
            lm.clear_cache()
            served = torch.as_tensor(np.asarray(lm.batch_next_token_logprobs_sync(rows)))
            after = trainer_rows(policy, rows)
            times = [t for t, _ in chunks]
            held = sum(timing["paused_at"] < t < timing["continued_at"] for t in times)
            first, last = (chunks[0][1]["meta_info"], chunks[-1][1]["meta_info"]) if chunks else ({}, {})
            lines.append(
                dict(
                    timing,
                    sync=sync,
                    gap=max_gap(served, after),
                    stale=max_gap(served, before),
                    before_pause=sum(t <= timing["paused_at"] for t in times),
                    held=held,
                    after=sum(t >= timing["continued_at"] for t in times),
                    finish=(last.get("finish_reason") or {}).get("type"),
                    tokens=last.get("completion_tokens"),
                    versions=f"{first.get('weight_version')} → {last.get('weight_version')}",
                )
            )
            print(
                json.dumps({k: v for k, v in lines[-1].items() if k not in ("paused_at", "continued_at")}),
                flush=True,
            )
        sender.shutdown()

        weights = dict(policy.state_dict())
        # the receiver's NCCL settings as the gateway's own: its environment's, else the trainer's
        alone = broadcast_alone(weights, {**TRAINER_NCCL_ENV, **gateway_env}, args.syncs, tmp, device.type)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"\n{len(weights)} tensors, {nbytes / 2**30:.2f} GiB ({args.dtype}); noise {args.noise} per sync\n")
    print(
        "| sync | pause ms | announce + broadcast + load ms | continue ms | sync ms | broadcast alone ms "
        "| sync ÷ broadcast | max \\|gateway − trainer\\| nat | max \\|gateway − before\\| nat "
        "| stream chunks before / held / after | finish (tokens) | weight version first → last chunk |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | --- | --- |")
    for line, reference in zip(lines, alone, strict=True):
        print(
            f"| {line['sync']} | {line['pause'] * 1e3:.1f} | {line['update'] * 1e3:.1f} | "
            f"{line['continue'] * 1e3:.1f} | {line['total'] * 1e3:.1f} | {reference * 1e3:.1f} | "
            f"{line['total'] / reference:.2f} | {line['gap']:.3f} | {line['stale']:.2f} | "
            f"{line['before_pause']} / {line['held']} / {line['after']} | {line['finish']} ({line['tokens']}) | {line['versions']} |"
        )
    later = lines[1:] or lines
    sync_ms = statistics.median(x["total"] for x in later) * 1e3
    alone_ms = statistics.median(alone[1:] or alone) * 1e3
    print(
        f"\nmedian of syncs 2..{len(lines)}: {sync_ms:.1f} ms per sync, {alone_ms:.1f} ms broadcast alone: "
        f"the gateway adds {100 * (sync_ms / alone_ms - 1):.0f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command")
    receiver = sub.add_parser("receive", help="the reference receiver (started by the bench)")
    for name in ("--port", "--syncs"):
        receiver.add_argument(name, type=int, required=True)
    receiver.add_argument("--group", required=True)
    receiver.add_argument("--announced", required=True)
    add_model_arguments(parser)
    parser.set_defaults(dtype="bfloat16", device="cuda")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8, help="rows compared after each sync")
    parser.add_argument("--noise", type=float, default=0.002, help="std of the noise added to each weight")
    parser.add_argument("--stream-tokens", type=int, default=512)
    parser.add_argument("--trainer-gpu", type=int, default=0)
    parser.add_argument("--gateway-gpu", type=int, default=1)
    parser.add_argument("--timeout-s", type=int, default=120, help="the gateway's weight_sync_timeout_s")
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        help="KEY=VALUE for the gateway's environment (KEY= unsets)",
    )
    args = parser.parse_args()
    if args.command == "receive":
        receive(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
