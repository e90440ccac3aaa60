"""One pass of the transformers engine's step scheduler: what each submission's caller needs of
the rows computed for it, and nothing more crosses to the host.

A submission (a group of items) is a dense-row call or one generation step; a pass made only of
greedy streams' steps may take several steps of each at once, each step's token fed to the next
on the device (the decode lane), so the host does not stand between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backends.placement import distinct_positions
from backends.sampling import Pick
from backends.step_scheduler import split_rows
from backends.transformers.dense_rows import DenseRows
from backends.transformers.host_copy import (
    WrittenRows,
    greedy_picks,
    picks_from_best,
    rows_to_host,
    write_rows_into,
)
from backends.types import PassStats

DEFAULT_STEPS_AHEAD = 16  # most greedy steps one pass takes of a stream, tokens fed back on the device


@dataclass(frozen=True)
class GreedySteps:
    """A greedy stream's next steps, of which a pass takes up to `steps` where the decode lane can
    feed each step's token to the next on the device; its result is their Picks, in order."""

    alternatives: int  # entries each Pick holds
    steps: int


# A row to compute (int32 ids), its key (backends/rows.py), its adapter, and what its caller
# needs of it: None, the whole row on the host; a number, a greedy stream's Pick with that many
# alternatives; GreedySteps, a list of such Picks; WrittenRows, the call's rows written into host
# memory from the device (the same for every row of the call).
StepItem = tuple[np.ndarray, bytes, str | None, int | GreedySteps | WrittenRows | None]
StepResult = np.ndarray | Pick | list[Pick] | None


def pass_results(
    dense: DenseRows,
    groups: list[Sequence[StepItem]],
    *,
    use_lane: bool,
    stats: PassStats,
    host_memory: Any,
) -> list[StepResult]:
    """Each group's rows on the host, its greedy stream's Pick (or Picks), or (None) its rows
    written into host memory from the device: only rows a caller reads cross to the host, once.
    A row that several groups ask for (the same adapter) is computed once, by placement's rule."""
    ahead = steps_ahead(dense, groups, stats) if use_lane else None
    if ahead is not None:
        return ahead
    items = [item for group in groups for item in group]
    rows, keys, adapters = [i[0] for i in items], [i[1] for i in items], [i[2] for i in items]
    positions = None  # a group's own rows are distinct already (backends/placement.py)
    if len(groups) > 1:
        firsts, positions = distinct_positions(keys, adapters)
        if positions is not None:
            rows, keys, adapters = ([column[i] for i in firsts] for column in (rows, keys, adapters))
    computed = dense(rows, keys, adapters, use_lane=use_lane)
    stats.rows += len(rows)
    if positions is not None:  # each group's rows, in its own order
        computed = computed[torch.tensor(positions, device=computed.device)]
    results: list[StepResult] = [None] * len(groups)
    ends = np.cumsum([len(group) for group in groups]).tolist()
    spans = [(end - len(group), end) for group, end in zip(groups, ends, strict=True)]
    wants = [group[0][3] for group in groups]
    picked = [i for i, want in enumerate(wants) if isinstance(want, int | GreedySteps)]
    if picked:  # one item per generation step
        first = [spans[i][0] for i in picked]
        # A pass of generation steps alone picks from every row in order: no gathered copy.
        chosen = computed if first == list(range(len(computed))) else computed[first]
        picks = greedy_picks(chosen, [_alternatives(wants[i]) for i in picked])
        for i, pick in zip(picked, picks, strict=True):
            results[i] = [pick] if isinstance(wants[i], GreedySteps) else pick
    for (start, end), want in zip(spans, wants, strict=True):
        if isinstance(want, WrittenRows):  # repeats copied on the device
            write_rows_into(computed[start:end], want.arrays, want.positions, host_memory)
    wanted = [i for i, want in enumerate(wants) if want is None]
    if wanted:
        kept = (
            computed
            if len(wanted) == len(groups)
            else computed[[r for i in wanted for r in range(*spans[i])]]
        )
        for i, rows_of_group in zip(
            wanted, split_rows(rows_to_host(kept), [groups[i] for i in wanted]), strict=True
        ):
            results[i] = rows_of_group
    return results


def steps_ahead(
    dense: DenseRows, groups: list[Sequence[StepItem]], stats: PassStats
) -> list[StepResult] | None:
    """A pass of greedy streams alone, one of them at least wanting more than one step: as many
    steps as the most wanted, each row fed its last token on the device (DenseRows.greedy_steps);
    a stream wanting fewer (its response ends sooner) takes its own, the rest of its row's
    steps computed for nothing. None where that cannot be."""
    wants = [group[0][3] for group in groups]
    if not all(isinstance(want, int | GreedySteps) for want in wants):
        return None
    wanted = [want.steps if isinstance(want, GreedySteps) else 1 for want in wants]  # type: ignore[union-attr]
    if max(wanted) == 1 or any(group[0][2] is not None for group in groups):  # adapters: not in the lane
        return None
    alternatives = [_alternatives(want) for want in wants]
    rows, keys = [g[0][0] for g in groups], [g[0][1] for g in groups]
    host = dense.greedy_steps(rows, keys, max(wanted), max(alternatives))
    if host is None:
        return None
    stats.rows += host.shape[0] * host.shape[1]
    per_step = [picks_from_best(step, alternatives) for step in host]
    results: list[StepResult] = []
    for i, (want, steps) in enumerate(zip(wants, wanted, strict=True)):
        picks = [step[i] for step in per_step[:steps]]
        results.append(picks if isinstance(want, GreedySteps) else picks[0])
    return results


def _alternatives(want: Any) -> int:
    return want.alternatives if isinstance(want, GreedySteps) else want
