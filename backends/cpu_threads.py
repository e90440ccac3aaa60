"""The threads of the engines' math on the CPU (torch's intra-op pool), set once by `serve` before
any model loads.

torch takes a thread per core by default. On a machine that the gateway shares with its clients
(an SMC loop beside it) or with other work, threads that outnumber the free cores wait on each
other at every operation, and a busy machine makes the gateway many times slower
(docs/performance.md, "A busy machine"). The setting `threads` (0: automatic) picks their number;
OMP_NUM_THREADS, where set, is taken as the operator's choice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def cpus_available() -> int:
    """The CPUs this process may run on (its affinity, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def compute_threads(setting: int, environ: Mapping[str, str]) -> int:
    """`setting` when given; else OMP_NUM_THREADS when set; else half the CPUs available (at
    least one), leaving the other half to the clients and work beside the gateway."""
    if setting:
        return setting
    configured = environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, cpus_available() // 2)


def use_compute_threads(setting: int) -> int:
    """Set torch's threads (and OMP_NUM_THREADS, for engine processes started later) once; returns
    how many."""
    import torch

    threads = compute_threads(setting, os.environ)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads
