"""Per-row LoRA adapters for MLX models, from PEFT adapter directories.

mlx-lm's own LoRA layers apply one adapter to the whole model. Here each targeted linear layer is
wrapped once in `MultiLoRALinear`, which holds any number of adapters and, for each forward pass,
adds to every row the low-rank update of that row's adapter (none for base rows). The engine sets
the rows' adapters right before the forward pass, on its single MLX thread.

PEFT stores `lora_A.weight` [r, in] and `lora_B.weight` [out, r] with scale lora_alpha / r
(lora_alpha / sqrt(r) with rsLoRA); the update is scale * x A^T B^T.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backends.errors import AdapterError


@dataclass
class _Adapters:
    """Kept outside MLX's parameter tree (a plain object, not a dict or array attribute)."""

    weights: dict[str, tuple[mx.array, mx.array, float]] = field(
        default_factory=dict
    )  # name -> (A, B, scale)
    rows: Sequence[str | None] = ()


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.store = _Adapters()

    @property
    def in_out(self) -> tuple[int, int]:
        out_dims, in_dims = self.base.weight.shape
        return in_dims, out_dims

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        rows = self.store.rows
        for name in {r for r in rows if r is not None}:
            a, b, scale = self.store.weights[name]
            mask = mx.array([1.0 if r == name else 0.0 for r in rows], dtype=y.dtype).reshape(-1, 1, 1)
            y = y + mask * ((scale * ((x @ a) @ b)).astype(y.dtype))
        return y


def _module(root: Any, dotted: str) -> tuple[Any, str, Any]:
    """(parent, attribute, module) for a dotted path such as model.layers.3.self_attn.q_proj."""
    *path, attr = dotted.split(".")
    parent = root
    for part in path:
        parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
    return parent, attr, getattr(parent, attr)


class AdapterSet:
    """The adapters of one MLX model."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers: dict[str, MultiLoRALinear] = {}
        self.names: set[str] = set()

    def set_rows(self, adapters: Sequence[str | None]) -> None:
        unknown = {a for a in adapters if a is not None} - self.names
        if unknown:
            raise AdapterError(f"adapter(s) not loaded: {', '.join(sorted(unknown))}")
        for layer in self.layers.values():
            layer.store.rows = adapters

    def load(self, name: str, path: str) -> None:
        directory = Path(path)
        try:
            config = json.loads((directory / "adapter_config.json").read_text())
            tensors = mx.load(str(directory / "adapter_model.safetensors"))
        except (OSError, ValueError, RuntimeError) as exc:  # MLX reports a corrupt file as RuntimeError
            raise AdapterError(f"adapter {name!r} cannot be read: {exc}") from exc
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        updates: dict[str, tuple[mx.array, mx.array, float]] = {}
        for key, value in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            dotted = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b_key = key.replace(".lora_A.weight", ".lora_B.weight")
            if b_key not in tensors:
                raise AdapterError(f"adapter {name!r}: {b_key} is missing")
            updates[dotted] = (value.T.astype(mx.float32), tensors[b_key].T.astype(mx.float32), scale)
        if not updates:
            raise AdapterError(f"adapter {name!r} has no LoRA weights")
        targets = {
            dotted: self._wrap(name, dotted) for dotted in updates
        }  # validate before changing anything
        for dotted, (a, b, _) in updates.items():
            in_dims, out_dims = targets[dotted].in_out
            if a.shape != (in_dims, rank) or b.shape != (rank, out_dims):
                raise AdapterError(
                    f"adapter {name!r}: {dotted} has shapes {a.shape}, {b.shape}, "
                    f"the model needs ({in_dims}, {rank}), ({rank}, {out_dims})"
                )
        for dotted, weights in updates.items():
            layer = targets[dotted]
            if dotted not in self.layers:
                parent, attr, _ = _module(self.model, dotted)
                setattr(parent, attr, layer)
                self.layers[dotted] = layer
            layer.store.weights[name] = weights
        mx.eval([array for a, b, _ in updates.values() for array in (a, b)])
        self.names.add(name)

    def _wrap(self, name: str, dotted: str) -> MultiLoRALinear:
        if dotted in self.layers:
            return self.layers[dotted]
        try:
            _, _, module = _module(self.model, dotted)
        except (AttributeError, IndexError, ValueError):
            raise AdapterError(f"adapter {name!r} targets {dotted}, which this model does not have") from None
        if not isinstance(module, nn.Linear):
            raise AdapterError(f"adapter {name!r} targets {dotted}, which is not a linear layer")
        return MultiLoRALinear(module)

    def unload(self, name: str) -> None:
        if name not in self.names:
            raise AdapterError(f"adapter {name!r} is not loaded")
        for layer in self.layers.values():
            layer.store.weights.pop(name, None)
        self.names.discard(name)
