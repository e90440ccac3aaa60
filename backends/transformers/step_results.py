"""What one pass of the transformers engine computes for the submissions of its step scheduler:
each submission's rows on the host, its greedy stream's Pick, or its rows written into the caller's
host memory from the device. Only rows a caller reads cross to the host, once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from backends.rows import first_positions
from backends.sampling import Pick
from backends.step_scheduler import split_rows
from backends.transformers.dense_rows import DenseRows
from backends.transformers.host_copy import (
    CudaHostMemory,
    WrittenRows,
    greedy_picks,
    rows_to_host,
    write_rows_into,
)
from backends.types import PassStats

# A row to compute (int32 ids), its key (backends/rows.py), its adapter, and what its caller
# needs of it: None, the whole row on the host; a number, a greedy stream's Pick with that many
# alternatives; WrittenRows, the call's rows written into host memory from the device (the same
# for every row of the call).
StepItem = tuple[np.ndarray, bytes, str | None, int | WrittenRows | None]
StepResult = np.ndarray | Pick | None


def computed_steps(
    dense_rows: DenseRows,
    groups: Sequence[Sequence[StepItem]],
    *,
    use_lane: bool,
    keep_lane: bool,
    host_memory: CudaHostMemory | None,
    stats: PassStats,
) -> list[StepResult]:
    """Each group's result, in order. A row that several groups ask for (the same adapter) is
    computed once. `use_lane` and `keep_lane`: as DenseRows takes them."""
    items = [item for group in groups for item in group]
    rows, keys, adapters = [i[0] for i in items], [i[1] for i in items], [i[2] for i in items]
    positions = None  # a group's own rows are distinct already (backends/placement.py)
    if len(groups) > 1:
        firsts, positions = first_positions(list(zip(adapters, keys, strict=True)))
        if positions is not None:
            rows, keys, adapters = ([column[i] for i in firsts] for column in (rows, keys, adapters))
    dense = dense_rows(rows, keys, adapters, use_lane=use_lane, keep_lane=keep_lane)
    stats.rows += len(rows)
    if positions is not None:  # each group's rows, in its own order
        dense = dense[torch.tensor(positions, device=dense.device)]
    results: list[StepResult] = [None] * len(groups)
    ends = np.cumsum([len(group) for group in groups]).tolist()
    spans = [(end - len(group), end) for group, end in zip(groups, ends, strict=True)]
    picked = [i for i, group in enumerate(groups) if isinstance(group[0][3], int)]
    if picked:  # one item per generation step
        first = [spans[i][0] for i in picked]
        picks = greedy_picks(dense[first], [groups[i][0][3] for i in picked])  # type: ignore[misc]
        for i, pick in zip(picked, picks, strict=True):
            results[i] = pick
    for (start, end), group in zip(spans, groups, strict=True):
        into = group[0][3]
        if isinstance(into, WrittenRows):  # repeats copied on the device
            write_rows_into(dense[start:end], into.arrays, into.positions, host_memory)
    wanted = [i for i, group in enumerate(groups) if group[0][3] is None]
    if wanted:
        kept = dense if len(wanted) == len(groups) else dense[[r for i in wanted for r in range(*spans[i])]]
        for i, rows_of_group in zip(
            wanted, split_rows(rows_to_host(kept), [groups[i] for i in wanted]), strict=True
        ):
            results[i] = rows_of_group
    return results
