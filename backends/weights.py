"""New weights of the same architecture, copied into a loaded torch model in place.

In place, so whatever holds the parameters' memory stays valid: torch.compile's code and the
CUDA graphs the decode lane captured read the parameters where they lie. Every tensor is found and
checked before the first one is copied: a directory whose weights do not fit changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from backends.base import WeightsError


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                tensors[name] = f.get_tensor(name)
    return tensors


def _check_architecture(model: Any, path: Path) -> None:
    config = path / "config.json"
    if not config.is_file():
        raise WeightsError(f"{path} has no config.json")
    try:
        architectures = json.loads(config.read_text()).get("architectures")
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{config} cannot be read: {exc}") from exc
    ours = getattr(model.config, "architectures", None)
    if architectures and ours and list(architectures) != list(ours):
        raise WeightsError(f"{path} holds a {architectures[0]}, this model is a {ours[0]}")


def _shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape, from the safetensors headers alone."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                shapes[name] = list(f.get_slice(name).get_shape())
    return shapes


def check_same_tensors(current: str | Path, new: str | Path) -> None:
    """WeightsError unless the directory `new` holds every tensor of the checkpoint `current`
    with the same shape, and a config of the same architecture: for an engine whose own reload
    (vLLM's) would find out halfway."""
    current, new = Path(current), Path(new)
    if not new.is_dir():
        raise WeightsError(f"{new} is not a directory")
    for directory in (current, new):
        if not (directory / "config.json").is_file():
            raise WeightsError(f"{directory} has no config.json")
    ours = json.loads((current / "config.json").read_text()).get("architectures")
    theirs = json.loads((new / "config.json").read_text()).get("architectures")
    if ours and theirs and list(ours) != list(theirs):
        raise WeightsError(f"{new} holds a {theirs[0]}, this model is a {ours[0]}")
    old, fresh = _shapes(current), _shapes(new)
    if not fresh:
        raise WeightsError(f"{new} has no .safetensors weights")
    for name, shape in old.items():
        if name not in fresh:
            raise WeightsError(f"{new} has no tensor {name!r}")
        if fresh[name] != shape:
            raise WeightsError(f"{new}: {name!r} has shape {fresh[name]}, this model's has {shape}")


def _checkpoint_name(name: str) -> str:
    """A parameter's name in a checkpoint of the plain model: PEFT wraps adapted layers, whose own
    weights move to `base_layer`."""
    return name.replace(".base_layer.", ".")


def copy_weights_in_place(model: Any, path: str | Path) -> None:
    """Every parameter of `model` (a transformers model, PEFT's adapter weights aside) from the
    safetensors files of the directory `path`, converted to the parameter's dtype and device."""
    path = Path(path)
    if not path.is_dir():
        raise WeightsError(f"{path} is not a directory")
    _check_architecture(model, path)
    tensors = _checkpoint(path)
    pairs = []
    for name, parameter in model.named_parameters():  # tied weights appear once
        if "lora_" in name:
            continue
        source = tensors.get(_checkpoint_name(name))
        if source is None:
            raise WeightsError(f"{path} has no tensor {_checkpoint_name(name)!r}")
        if source.shape != parameter.shape:
            raise WeightsError(
                f"{path}: {_checkpoint_name(name)!r} has shape {list(source.shape)}, "
                f"this model's has {list(parameter.shape)}"
            )
        pairs.append((parameter, source))
    with torch.no_grad():
        for parameter, source in pairs:
            parameter.copy_(source)
