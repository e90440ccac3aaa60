"""What the answer to a dense call waits for on a GPU: the device's copies of one step's rows.

    python -m bench.host_copies --particles 16 64 256

The engine writes the rows into the client's memory (registered with the driver) and, with an
output cache, into page-locked rows of its own for the cache. Prints the median ms from the
copies' start to the answer's rows having landed, three ways: the client's copy alone, both
copies with the answer waiting for both, and both with the cache's copy landing after the answer
(`write_rows_into` with the engine's host memory, as the engine does). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from backends.transformers.host_copy import CudaHostMemory, write_rows_into


def answer_ms(
    rows: torch.Tensor, into: np.ndarray, own: np.ndarray, memory: CudaHostMemory, way: str, n: int
):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        started = time.perf_counter()
        if way == "client's copy alone":
            write_rows_into(rows, (into,), None)
        elif way == "both, answer waits":
            write_rows_into(rows, (into, own), None)
        else:
            write_rows_into(rows, (into, own), None, memory)
        times.append(time.perf_counter() - started)
        memory.wait_landed(own)
    return statistics.median(times[n // 5 :]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--particles", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    memory = CudaHostMemory(args.vocab)
    ways = ["client's copy alone", "both, answer waits", "both, cache's copy after"]
    print(f"\n### ms until the answer's rows have landed, {torch.cuda.get_device_name()}\n")
    print("| P | MiB | " + " | ".join(ways) + " |")
    print("| ---: | ---: |" + " ---: |" * len(ways))
    for p in args.particles:
        rows = torch.randn(p, args.vocab, device="cuda")
        into = np.zeros((p, args.vocab), np.float32)
        memory.register(into.ctypes.data, into.nbytes)
        own = memory.empty(p)
        cells = [answer_ms(rows, into, own, memory, way, args.calls) for way in ways]
        expected = rows.cpu().numpy()
        assert np.array_equal(into, expected) and np.array_equal(own, expected)
        memory.unregister(into.ctypes.data)
        print(f"| {p} | {into.nbytes / 2**20:.0f} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
