"""The identity of a model's weights, read without reading the weights: the part of every
output-cache key that changes when the weights do."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path


def weights_fingerprint(model_dir: str | Path, *extra: str) -> str:
    """Identity of a model's weights without reading them: config.json and every safetensors
    header (tensor names, dtypes, shapes, offsets), plus `extra` (backend, dtype, ...)."""
    digest = hashlib.sha256()
    for part in extra:
        digest.update(part.encode() + b"\0")
    root = Path(model_dir)
    for name in ("config.json", "model.safetensors.index.json"):
        if (root / name).is_file():
            digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        with weights.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            digest.update(weights.name.encode() + b"\0" + f.read(min(size, 100_000_000)))
    return digest.hexdigest()


def weight_files_stat(path: str | Path) -> list[str]:
    """Name, size and modification time of each weights file: a checkpoint written again with the
    same tensor shapes (a training step) has the same headers but not the same files."""
    return [
        f"{file.name}:{file.stat().st_size}:{file.stat().st_mtime_ns}"
        for file in sorted(Path(path).glob("*.safetensors"))
    ]
