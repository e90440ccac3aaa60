"""Types shared by several endpoints."""

from __future__ import annotations

from typing import Annotated

import msgspec

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
# Free text the gateway stores, echoes or compares (names, ids, versions, stop strings): bounded
# at decode, so none of it is carried around at the body's size (a 400 beyond)
Name = Annotated[str, msgspec.Meta(max_length=256)]
ModelName = Annotated[str, msgspec.Meta(max_length=512)]  # `base:adapter`
FilePath = Annotated[str, msgspec.Meta(max_length=4096)]
StopString = Annotated[str, msgspec.Meta(max_length=1024)]
Stop = StopString | list[StopString]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


def sampling_seed(seed: int | None) -> int | None:
    """Negative seeds as the unsigned 64-bit seed they wrap to (numpy's generators refuse
    negative seeds; choices after the first already wrap this way)."""
    return None if seed is None else seed % 2**64


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
