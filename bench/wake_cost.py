"""How fast the same small piece of the gateway's Python runs, by what its thread did just before.

    python -m bench.wake_cost --particles 64

Times `unpack_rows` (a dense request's token checks, 64 rows of 30 ids) right after: nothing
(back to back), sleeping 2 ms (as the event loop sleeps through an engine call), a busy 2 ms,
reading 12 MB (an SMC step's rows), and torch's inverse-CDF sampling of the rows. Prints the
median wall-clock and thread CPU µs of each: where they differ from back to back, the code ran
cold (its caches flushed, its core woken from idle), not longer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gateway.dense.token_rows import unpack_rows
from logprob_gateway_client.wire import pack_ids

VOCAB = 49152


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    p = args.particles
    rows = [list(range(100 + i, 130 + i)) for i in range(p)]
    packed, lengths = b"".join(map(pack_ids, rows)), [len(r) for r in rows]
    logprobs = torch.log_softmax(torch.randn(p, VOCAB), 1)
    rows_read = np.ones((12 << 20) // 8)
    generator = torch.Generator().manual_seed(0)

    def sample() -> None:
        cdf = torch.cumsum(torch.exp(logprobs), dim=1)
        torch.searchsorted(cdf, torch.rand(p, 1, generator=generator) * cdf[:, -1:])

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    before = {
        "back to back": lambda: None,
        "sleep 2 ms": lambda: time.sleep(0.002),
        "busy 2 ms": lambda: busy(0.002),
        "read 12 MB": rows_read.sum,
        "torch sampling": sample,
    }
    print(f"\n### unpack_rows of {p} rows, median µs, after ({torch.get_num_threads()} torch threads)\n")
    print("| before it | wall | thread CPU |\n| --- | ---: | ---: |")
    for name, step in before.items():
        wall, cpu = [], []
        for _ in range(args.repeats):
            step()
            started, started_cpu = time.perf_counter(), time.thread_time()
            unpack_rows(packed, lengths, VOCAB, "input")
            wall.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - started_cpu)
        print(f"| {name} | {statistics.median(wall) * 1e6:.1f} | {statistics.median(cpu) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
