"""How long the transformers engine takes to start where its decode lane is compiled: loading the
weights, then compiling and capturing the lane's step (`decode_lane_compile`, on by default on
CUDA), with torch's on-disk compile caches empty (a first start on a machine) and then filled by
the start before (a restart).

    python -m bench.lane_compile --random-model llama-8b --tokenizer DIR --device cuda --dtype bfloat16
    python -m bench.lane_compile --repeats 1       # SmolLM2-135M on this CPU, the lane turned on

Each start runs in a process of its own (`TORCHINDUCTOR_CACHE_DIR` a new directory for a cold
start, the same one again for a warm start), loads one TransformersEngine as `serve` does and
reads the engine's log for when the lane's compile began and ended. Prints one Markdown table:
per start the seconds to load the weights and the seconds until the lane's step was ready.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.smc import add_model_arguments, random_model_dir

READY = "decode lane's step ready"


def start(args: argparse.Namespace, model: str) -> tuple[float, float]:
    """In this process: load the engine; (seconds to the lane's compile, seconds of the compile)."""
    from backends.transformers.engine import TransformersEngine
    from backends.types import EngineConfig

    began, marks = time.perf_counter(), {}

    class Marks(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("compiling the decode lane"):
                marks["compile"] = time.perf_counter()
            elif message.startswith(READY):
                marks["ready"] = time.perf_counter()

    engine_log = logging.getLogger("backends.transformers.engine")
    engine_log.setLevel(logging.INFO)
    engine_log.addHandler(Marks())
    options = {} if args.device.startswith("cuda") else {"decode_lane_rows": 512, "decode_lane_compile": True}
    config = EngineConfig(model=model, dtype=args.dtype, device=args.device, options=options)
    TransformersEngine.load(config)
    if "ready" not in marks:
        raise SystemExit("the decode lane was not compiled (off, or torch.compile failed: see the log)")
    return marks["compile"] - began, marks["ready"] - marks["compile"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--repeats", type=int, default=2, help="cold starts, each followed by a warm one")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the model directory, in a start's own process
    args = parser.parse_args()
    if args.child:
        print(*start(args, args.child))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.random_model:
            print(f"building random {args.random_model} weights", file=sys.stderr, flush=True)
            model = str(
                random_model_dir(args.random_model, *_dtype_device(args), Path(tmp) / "model", args.tokenizer)
            )
        runs: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
        for repeat in range(args.repeats):
            caches = Path(tmp) / f"caches-{repeat}"
            for kind in runs:  # the warm start finds what the cold one left
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches))
                command = [sys.executable, "-m", "bench.lane_compile", "--child", model]
                command += ["--device", args.device, "--dtype", args.dtype]
                out = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
                load_s, compile_s = map(float, out.split()[-2:])
                print(
                    f"{kind} start: load {load_s:.1f} s, lane compiled in {compile_s:.1f} s", file=sys.stderr
                )
                runs[kind].append((load_s, compile_s))
    shape = args.random_model or args.model
    print(f"### Starts of the transformers engine, {shape}, {args.device}, {args.dtype}\n")
    print(
        "| torch's compile caches | starts | load s (median) | lane compile s (median) | lane compile s (all) |"
    )
    print("| --- | ---: | ---: | ---: | --- |")
    for kind, values in runs.items():
        loads, compiles = zip(*values, strict=True)
        every = ", ".join(f"{c:.1f}" for c in compiles)
        print(
            f"| {kind} | {len(values)} | {statistics.median(loads):.1f} | {statistics.median(compiles):.1f} | {every} |"
        )


def _dtype_device(args: argparse.Namespace) -> tuple:
    from backends.transformers.engine import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    return resolve_dtype(args.dtype, device), device


if __name__ == "__main__":
    main()
