"""LoRA adapters: where they may be loaded from, what a valid one looks like, and its identity.

A shared service must not load arbitrary files: adapters loaded at run time must lie inside the
model's `adapters_root` (after resolving symlinks), and so must every file in their directory (a
symlinked `adapter_model.safetensors` pointing elsewhere is refused); they must be PEFT LoRA
adapters with safetensors weights (never pickles) and a rank within `max_lora_rank`. A path the
filesystem itself rejects (a NUL byte, a name too long, a symlink loop, no permission) is the
caller's error, never the server's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from pathlib import Path

from gateway.errors import ForbiddenError, InvalidRequestError

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
WEIGHTS = "adapter_model.safetensors"


def check_adapter_name(name: str) -> str:
    if not ADAPTER_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit",
            param="lora_name",
        )
    return name


def _unusable_path(exc: Exception) -> InvalidRequestError:
    """The filesystem's reason, without the path (which may be kilobytes long)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        reason = os.strerror(exc.errno)
    elif isinstance(exc, RuntimeError):  # pathlib's report of a symlink loop
        reason = os.strerror(errno.ELOOP)
    else:
        reason = str(exc)
    return InvalidRequestError(f"lora_path is not a usable path: {reason}", param="lora_path")


def confine(root: str | None, given: str) -> Path:
    """`given` (relative to `root`, or absolute) resolved, and refused unless it lies inside `root`."""
    if root is None:
        raise ForbiddenError(
            "loading adapters at run time is disabled for this model (no adapters_root)", param="lora_path"
        )
    base = Path(root).resolve()
    try:
        candidate = (base / given).resolve()
    except (OSError, ValueError, RuntimeError) as exc:
        raise _unusable_path(exc) from None
    if not candidate.is_relative_to(base):
        raise ForbiddenError("lora_path must lie inside the adapters root of this model", param="lora_path")
    return candidate


def check_adapter_dir(path: Path, max_rank: int, root: str | None = None) -> dict:
    """The adapter's config, after checking it is a loadable PEFT LoRA adapter within limits and,
    with a `root`, that every file of its directory resolves inside it."""
    try:
        if root is not None:
            _confine_files(path, root)
        return _check_adapter_files(path, max_rank)
    except OSError as exc:
        raise _unusable_path(exc) from None


def leaving_entry(directory: Path, base: Path) -> Path | None:
    """The first entry of `directory` that resolves outside `base` (a symlink loop counts), if any:
    engines read files of a directory by name (PEFT, vLLM and MLX do not all read the same ones),
    so none may lead outside a root, whatever its name. OSError as the filesystem raises it."""
    for entry in directory.iterdir():
        try:
            if not entry.resolve().is_relative_to(base):
                return entry
        except RuntimeError:  # a symlink loop
            return entry
    return None


def _confine_files(path: Path, root: str) -> None:
    if not path.is_dir():  # nothing to read here: the checks that follow say what is missing
        return
    entry = leaving_entry(path, Path(root).resolve())
    if entry is not None:
        raise ForbiddenError(
            f"{entry.name!r} in the adapter directory leads outside the adapters root", param="lora_path"
        )


def _check_adapter_files(path: Path, max_rank: int) -> dict:
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
    """Identity of the adapter's weights for cache keys: its config and every byte of its weights.
    Two checkpoints of one LoRA config have the same safetensors header, and a name reused for
    either must not find the other's rows (here, or through Redis on another replica); an
    adapter's weights are small, and the engine reads them all at load anyway."""
    try:
        digest = hashlib.sha256((path / "adapter_config.json").read_bytes())
        with (path / WEIGHTS).open("rb") as f:
            if len(f.read(8)) < 8:
                raise InvalidRequestError(f"{WEIGHTS} is not a safetensors file", param="lora_path")
            f.seek(0)
            hashlib.file_digest(f, lambda: digest)
    except OSError as exc:
        raise _unusable_path(exc) from None
    return digest.hexdigest()
