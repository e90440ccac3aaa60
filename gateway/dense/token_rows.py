"""A dense request's rows, checked, as the engine takes them (backends/rows.py). Packed rows
(`{"ids", "lengths"}`) are checked in one numpy pass and kept as they came: the engine computes
from those bytes, and each row's key is its slice of them; nothing walks the ids one by one."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial

import numpy as np

from backends.rows import INT32, PackedRows
from gateway.errors import InvalidRequestError, too_many_inputs
from gateway.models.served import ServedModel
from gateway.prompts import has_text, token_inputs
from gateway.schemas.logprobs import NextTokenLogprobsRequest, PackedTokenIds
from gateway.settings import Limits


def unpack_rows(ids: bytes, lengths: Sequence[int], vocab_size: int, param: str) -> PackedRows:
    """Row i is the next lengths[i] int32 ids of `ids`; the sizes, and each id against the
    vocabulary, are checked first (the first row at fault is named)."""
    counts = np.asarray(lengths, dtype=np.int64)
    total = int(counts.sum())
    if len(ids) % INT32.itemsize or len(ids) // INT32.itemsize != total:
        raise InvalidRequestError(
            f"{param}.ids holds {len(ids)} bytes; lengths ask for {total} int32 ids ({4 * total} bytes)",
            param=param,
        )
    rows = PackedRows.from_bytes(ids, counts)
    flat = rows.ids
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
        bad = int(np.flatnonzero((flat < 0) | (flat >= vocab_size))[0])
        row = int(np.searchsorted(rows.ends, bad, side="right"))
        raise InvalidRequestError(
            f"token id {int(flat[bad])} in row {row} of {param} is outside the vocabulary [0, {vocab_size})",
            param=param,
        )
    return rows


async def dense_inputs(served: ServedModel, body: NextTokenLogprobsRequest, limits: Limits) -> PackedRows:
    """The request's rows as checked token ids (text tokenized), within the limits."""
    value = body.input
    if isinstance(value, PackedTokenIds):
        if not value.lengths:
            raise InvalidRequestError("input.lengths must name at least one row", param="input")
        if len(value.lengths) > limits.max_rows:
            raise too_many_inputs(limits.max_rows, "input")
        return unpack_rows(value.ids, value.lengths, served.require_engine().info.vocab_size, "input")
    prepare = partial(
        token_inputs,
        served,
        value,
        add_special_tokens=body.add_special_tokens,
        limits=limits,
        max_items=limits.max_rows,
        param="input",
    )
    # Token-id rows are checked in one C pass; only text is worth a thread.
    inputs = await asyncio.to_thread(prepare) if has_text(value) else prepare()
    return PackedRows.of([i.ids for i in inputs])
