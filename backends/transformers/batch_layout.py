"""How the rows of a dense pass are laid out: grouped into forward passes by how many tokens each
must compute, left-padded with explicit positions and an attention mask, so that every row's
result equals its unpadded forward pass."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def plan_groups(todo: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rows (by index) into forward passes. A pass is as wide as its row with the most tokens to
    compute, so rows are grouped by that count (sorted; a new group when it would more than double
    plus 8, which keeps one-token extensions apart from fresh prompts) and each group holds at most
    `max_tokens` padded tokens (at least one row)."""
    groups: list[list[int]] = []
    first = 0
    for i in sorted(range(len(todo)), key=todo.__getitem__):
        if groups and todo[i] <= 2 * first + 8 and (len(groups[-1]) + 1) * todo[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
            first = todo[i]
    return groups


def left_padded(
    rows: Sequence[np.ndarray] | Sequence[Sequence[int]], skip: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids [rows, width] of every row without its first skip[i] tokens, left-padded; the
    attention mask [rows, max(skip) + width] of the whole rows, right-aligned, and the ids' positions.
    Built in numpy: per-row torch operations would each cost a dispatch on the engine's thread."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = int((lengths - np.asarray(skip, dtype=np.int64)).max())
    total = max(skip) + width
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, (row, s) in enumerate(zip(rows, skip, strict=True)):
        ids[i, width - (len(row) - s) :] = row[s:]
    mask = np.arange(total) >= (total - lengths)[:, None]
    positions = np.maximum(np.arange(width) + (lengths - width)[:, None], 0)
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), torch.from_numpy(positions)


def mask_if_padded(mask: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The attention mask, or None when no row is padded: attention kernels without a mask are
    the fast ones, and transformers then applies the causal mask itself."""
    return None if bool(mask.all()) else mask.to(device)
