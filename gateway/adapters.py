"""LoRA adapters: where they may be loaded from, what a valid one looks like, and its identity.

A shared service must not load arbitrary files: adapters loaded at run time must lie inside the
model's `adapters_root` (after resolving symlinks), be PEFT LoRA adapters with safetensors
weights (never pickles) and a rank within `max_lora_rank`.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

from gateway.errors import ForbiddenError, InvalidRequestError

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
WEIGHTS = "adapter_model.safetensors"


def check_adapter_name(name: str) -> str:
    if not ADAPTER_NAME.match(name):
        raise InvalidRequestError(
            f"adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit",
            param="lora_name",
        )
    return name


def confine(root: str | None, given: str) -> Path:
    """`given` (relative to `root`, or absolute) resolved, and refused unless it lies inside `root`."""
    if root is None:
        raise ForbiddenError(
            "loading adapters at run time is disabled for this model (no adapters_root)", param="lora_path"
        )
    base = Path(root).resolve()
    candidate = (base / given).resolve()
    if not candidate.is_relative_to(base):
        raise ForbiddenError("lora_path must lie inside the adapters root of this model", param="lora_path")
    return candidate


def check_adapter_dir(path: Path, max_rank: int) -> dict:
    """The adapter's config, after checking it is a loadable PEFT LoRA adapter within limits."""
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise InvalidRequestError(
            f"{path.name!r} is not a PEFT adapter (no adapter_config.json)", param="lora_path"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"adapter_config.json is unreadable: {exc}", param="lora_path") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise InvalidRequestError(
            "only PEFT LoRA adapters are supported (peft_type must be LORA)", param="lora_path"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or not 0 < rank <= max_rank:
        raise InvalidRequestError(f"adapter rank {rank!r} is outside 1..{max_rank}", param="lora_path")
    if not (path / WEIGHTS).is_file():
        raise InvalidRequestError(
            f"the adapter must ship its weights as {WEIGHTS} (pickled weights are refused)", param="lora_path"
        )
    return config


def adapter_fingerprint(path: Path) -> str:
    """Identity of the adapter's weights for cache keys: its config and safetensors header."""
    digest = hashlib.sha256((path / "adapter_config.json").read_bytes())
    with (path / WEIGHTS).open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        digest.update(f.read(min(size, 100_000_000)))
    return digest.hexdigest()
