"""The decode lane: dense rows that extend the last pass's rows by one token, in one fixed-shape step.

Sequential Monte Carlo and concurrent generation streams ask, pass after pass, for rows one token
longer than rows of the pass before (SMC's resampling repeats and drops some). The lane keeps the
keys/values of the last pass's rows in a transformers `StaticCache` of `slots` rows by `width`
columns, so such a pass is one decode step of fixed shape: on CUDA replayed from a CUDA graph
captured once per shape, with no Python or kernel launches per layer.

Layout. Every row is right-aligned at the write column: row i's n tokens sit in columns
column-n..column-1, and the step writes each row's new token at `column` (the cache's own
write position, which every layer keeps). The attention mask, built inside the step from the rows'
positions, keeps columns column-position..column of each row; whatever lies left of a row (another
row's old tokens, zeros) is masked. A step first gathers the parents into slot order when they are
not already there (SMC's resampling), so the lane holds exactly the rows of the last pass. Slots
are keyed by the rows' keys (backends/rows.py), and a row finds its parent by `parent_key`.

Shapes. Slots are a power of two (at least 8), width a multiple of 64 with room to grow; a pass
with more rows or a longer row moves the rows into a larger shape, and a much smaller pass into a
smaller one. Each shape is captured once and kept (least recently used first out past the byte
budget), so a workload that keeps its shape replays one graph.

The lane runs on the engine's worker thread, like every model call.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import StaticCache

from backends.rows import key_length, parent_key, row_key
from backends.transformers.lane_shape import KV, LaneShape, compiled_forward, kv_bytes

log = logging.getLogger(__name__)

MIN_SLOTS = 8
WIDTH_STEP = 64  # columns are added in these steps, so a growing row changes shape rarely
HEADROOM = 16  # columns at least left free for the rows to grow into


def lane_supported() -> bool:
    """The lane moves the write position of transformers' static cache layers itself."""
    from transformers.cache_utils import StaticLayer

    return hasattr(StaticLayer(max_cache_len=1), "cumulative_length") and hasattr(
        StaticCache, "early_initialization"
    )


def _slots_for(rows: int) -> int:
    return max(MIN_SLOTS, 1 << (rows - 1).bit_length())


def _width_for(longest: int) -> int:
    """Room for the longest row and a quarter more (at least HEADROOM columns) to grow into."""
    need = longest + max(HEADROOM, longest // 4)
    return -(-need // WIDTH_STEP) * WIDTH_STEP


class DecodeLane:
    def __init__(
        self,
        model: Any,
        *,
        max_slots: int,
        max_bytes: int,
        graphs: bool,
        compiled: bool = False,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """`max_bytes` bounds the shapes' K/V; `on_bytes` hears their total after each change (the
        prefix cache, whose budget the lane shares)."""
        self.model = model
        self._on_bytes = on_bytes
        # torch.compile's fused kernels, traced once for every shape (sizes symbolic)
        self.compiled = compiled
        self._forward = compiled_forward(model) if compiled else None
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self.graphs = graphs
        self._shapes: OrderedDict[tuple[int, int], LaneShape] = OrderedDict()
        self._shape: LaneShape | None = None  # the one holding the rows below
        self._slot_of: dict[bytes, int] = {}  # by the rows' keys (backends/rows.py)
        self._used = 0  # slots holding the last pass's rows (some empty where a row repeated)
        self._column = 0
        self.steps = 0  # passes served by the lane

    def prepare(self) -> None:
        """Build (and on CUDA capture, and compile) the smallest shape now rather than at the
        first request: with torch.compile that takes a while, once for every shape. Where
        torch.compile cannot build the step (no compiler, an unsupported model), the lane runs
        the model as it is."""
        try:
            self._shape_for(MIN_SLOTS, WIDTH_STEP).step()
        except Exception as exc:  # inductor's and dynamo's errors have no common base
            if not self.compiled:
                raise
            log.warning("decode lane: torch.compile failed (%s: %s); not compiled", type(exc).__name__, exc)
            self.compiled = False
            self.reset(self.model)
            self._shape_for(MIN_SLOTS, WIDTH_STEP).step()

    @property
    def nbytes(self) -> int:
        """Bytes of K/V the lane's shapes hold."""
        return sum(shape.nbytes for shape in self._shapes.values())

    def clear(self) -> None:
        """Forget the rows and every captured shape (the weights they were computed with changed)."""
        self._shapes.clear()
        self._shape = None
        self._slot_of = {}
        self._report_bytes()

    def _report_bytes(self) -> None:
        if self._on_bytes is not None:
            self._on_bytes(self.nbytes)

    def reset(self, model: Any) -> None:
        """Serve `model` from now on (the engine's model object changed)."""
        self.clear()
        self.model = model
        self._forward = compiled_forward(model) if self.compiled else None

    def parents(self, keys: Sequence[bytes]) -> list[int | None]:
        """Per row (by its key), the slot of the row it extends by one token, if the lane holds it."""
        slot_of = self._slot_of
        if not slot_of:
            return [None] * len(keys)
        return [slot_of.get(parent_key(key)) if key_length(key) > 1 else None for key in keys]

    def fits(self, rows: int, longest: int) -> bool:
        """Whether a shape for these rows fits beside the one now held (whose rows it copies)."""
        slots, width = _slots_for(rows), _width_for(longest)
        if slots > self.max_slots:
            return False
        held = self._shape.nbytes if self._shape is not None else 0
        need = kv_bytes(self.model, slots, width)
        return need <= self.max_bytes and ((slots, width) in self._shapes or held + need <= self.max_bytes)

    def step(self, rows: Sequence[np.ndarray], keys: Sequence[bytes], parents: Sequence[int]) -> torch.Tensor:
        """Log-probabilities [len(rows), vocab] of rows (int32 ids, and their keys) whose parents
        the lane holds (a view of the lane's output, valid until its next step)."""
        shape = self._shape
        assert shape is not None
        slots = _slots_for(len(rows))
        if slots > shape.slots or 4 * slots <= shape.slots or self._column >= shape.width:
            # Into a shape that fits: the rows' parents, in the rows' order.
            own = self.own_rows()
            assert own is not None
            self._refill([(own[0], list(parents))], [parent_key(key) for key in keys])
            shape = self._shape
            assert shape is not None
        elif any(p != i for i, p in enumerate(parents)):
            shape.gather(parents, self._column)
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        inputs = np.zeros((2, shape.slots, 1), dtype=np.int64)
        inputs[0, : len(rows), 0] = [row[-1] for row in rows]
        inputs[1, : len(rows), 0] = lengths - 1
        shape.ids.copy_(torch.from_numpy(inputs[0]))
        shape.positions.copy_(torch.from_numpy(inputs[1]))
        out = shape.step()[: len(rows)]  # the step moves the cache's write column on by one
        self._column += 1
        self._slot_of = dict(zip(keys, range(len(keys)), strict=True))  # slot i holds row keys[i]
        self._used = len(keys)
        self.steps += 1
        return out

    def greedy_steps(
        self,
        rows: Sequence[np.ndarray],
        keys: Sequence[bytes],
        parents: Sequence[int],
        steps: int,
        best: Callable[[torch.Tensor], torch.Tensor],
    ) -> np.ndarray:
        """`step`, then up to `steps` - 1 more, each row extended by its most likely token with no
        turn of the host between steps: each step's tokens are fed to the next on the device and
        `best` (backends/transformers/host_copy.py best_entries) reduces each step's rows there,
        [rows, C]. Returns `best`'s rows of every step taken, [taken, rows, C], in one copy to the
        host; the lane then holds the rows as extended by all but the last step's tokens."""
        n = len(rows)
        reduced = [best(self.step(rows, keys, parents))]  # into another shape first, where needed
        shape = self._shape
        assert shape is not None
        taken = min(steps, 1 + shape.width - self._column)  # the shape's columns bound the steps
        for _ in range(taken - 1):
            shape.ids[:n].copy_(reduced[-1][:, :1].long())  # the last step's tokens, where they are
            shape.positions[:n].add_(1)
            reduced.append(best(shape.step()[:n]))
            self._column += 1
        host = torch.stack(reduced).cpu().numpy()
        if taken > 1:  # the rows the lane holds now: each with the tokens fed to it
            fed = host[: taken - 1, :, 0].T.astype(np.int32)
            self._slot_of = {
                key + row_key(more): i for i, (key, more) in enumerate(zip(keys, fed, strict=True))
            }
            self.steps += taken - 1
        return host

    def own_rows(self) -> tuple[list[KV], list[bytes]] | None:
        """The lane's rows as a source for `refill`: K/V right-aligned at the write column, and
        the rows' keys by slot (b"" for a slot that holds none)."""
        if self._shape is None or not self._slot_of:
            return None
        keys = [b""] * self._used
        for key, slot in self._slot_of.items():
            keys[slot] = key
        return [(k[:, :, : self._column], v[:, :, : self._column]) for k, v in self._shape.layers], keys

    def rows_beside(self, new: int) -> tuple[list[KV], list[bytes]] | None:
        """`own_rows`, where they fit beside `new` rows in as many slots as those alone: rows of a
        pass without lane steps (new prompts only) keep the rows of the pass before, whose streams
        may come back a pass later (a burst that ended there), unless keeping them would make every
        step larger (streams that ended)."""
        own = self.own_rows()
        if own is None or _slots_for(len(own[1]) + new) > _slots_for(new):
            return None
        return own

    def refill(self, sources: Sequence[tuple[list[KV], Sequence[bytes]]]) -> None:
        """Hold exactly the rows of these sources: a forward pass's K/V (row i right-aligned at its
        last column) and the keys of the rows it holds, in order."""
        keys = [key for _, part in sources for key in part]
        if not keys or not self.fits(len(keys), max(map(key_length, keys)) + 1):
            self._slot_of = {}
            return
        self._refill([(layers, list(range(len(part)))) for layers, part in sources], keys)

    def _refill(self, sources: Sequence[tuple[list[KV], list[int]]], keys: list[bytes]) -> None:
        # sources: (K/V right-aligned at their last column, which of their rows), in slot order.
        longest = max(map(key_length, keys))
        shape = self._shape_for(_slots_for(len(keys)), _width_for(longest + 1))
        device = shape.ids.device
        parts = []  # copied out first: a source may be the target shape itself
        for layers, which in sources:
            end = layers[0][0].shape[2]
            n = min(longest, end)
            index = torch.tensor(which, device=device)
            parts.append([(k[index, :, end - n : end], v[index, :, end - n : end]) for k, v in layers])
        first = 0
        for part in parts:
            count, n = part[0][0].shape[0], part[0][0].shape[2]
            for (layer_keys, layer_values), (k, v) in zip(shape.layers, part, strict=True):
                layer_keys[first : first + count, :, longest - n : longest] = k
                layer_values[first : first + count, :, longest - n : longest] = v
            first += count
        shape.set_column(longest)
        self._shape = shape
        self._column = longest
        self._slot_of = {key: i for i, key in enumerate(keys) if key}
        self._used = len(keys)
        # the shape the rows came from may go now: past the budget, older shapes do
        for old in list(self._shapes):
            if self.nbytes <= self.max_bytes:
                break
            if self._shapes[old] is not shape:
                del self._shapes[old]
        self._report_bytes()

    def _shape_for(self, slots: int, width: int) -> LaneShape:
        key = (slots, width)
        shape = self._shapes.get(key)
        if shape is None:
            need = kv_bytes(self.model, slots, width)
            for old in list(self._shapes):
                if sum(s.nbytes for s in self._shapes.values()) + need <= self.max_bytes:
                    break
                if self._shapes[old] is not self._shape:
                    del self._shapes[old]
            shape = self._shapes[key] = LaneShape(self.model, slots, width, self.graphs, self._forward)
            log.info("decode lane: %d rows x %d columns%s", slots, width, ", captured" if self.graphs else "")
            self._report_bytes()
        self._shapes.move_to_end(key)
        return shape
