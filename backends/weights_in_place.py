"""New weights of the same architecture, copied into a loaded torch model in place.

In place, so whatever holds the parameters' memory stays valid: torch.compile's code and the
CUDA graphs the decode lane captured read the parameters where they lie. Every tensor is found and
checked before the first one is copied: a directory whose weights do not fit changes nothing.
Tensors received from a trainer (backends/transformers/weights_collective.py) are checked there,
then copied here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from backends.errors import WeightsError


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path} has no .safetensors weights")
    return files


def _architectures(path: Path) -> list[str] | None:
    """What the directory's config.json says the weights are; WeightsError without a directory or
    a readable config."""
    if not path.is_dir():
        raise WeightsError(f"{path} is not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise WeightsError(f"{path} has no config.json")
    try:
        return json.loads(config.read_text()).get("architectures")
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{config} cannot be read: {exc}") from exc


def _check_architecture(path: Path, theirs: Sequence[str] | None, ours: Sequence[str] | None) -> None:
    if theirs and ours and list(theirs) != list(ours):
        raise WeightsError(f"{path} holds a {theirs[0]}, this model is a {ours[0]}")


def _check_tensors(
    path: Path, shapes: Mapping[str, Sequence[int]], wanted: Iterable[tuple[str, Sequence[int]]]
) -> None:
    """WeightsError unless the tensors in `path`, of `shapes`, include every one `wanted`, shaped
    as wanted."""
    for name, shape in wanted:
        if name not in shapes:
            raise WeightsError(f"{path} has no tensor {name!r}")
        if list(shapes[name]) != list(shape):
            raise WeightsError(
                f"{path}: {name!r} has shape {list(shapes[name])}, this model's has {list(shape)}"
            )


def _read(path: Path, take: Callable[[Any, str], Any]) -> dict[str, Any]:
    """`take(file, name)` of each tensor in the safetensors files of `path`; WeightsError for a
    file that is no safetensors file or cannot be read."""
    found: dict[str, Any] = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    found[name] = take(f, name)
        except SafetensorError as exc:
            raise WeightsError(f"{file.name} is not a readable safetensors file: {exc}") from None
        except OSError as exc:
            raise WeightsError(f"{file.name} cannot be read: {exc.strerror or exc}") from None
    return found


def _shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape, from the safetensors headers alone."""
    return _read(path, lambda f, name: list(f.get_slice(name).get_shape()))


def check_same_tensors(current: str | Path, new: str | Path) -> None:
    """WeightsError unless the directory `new` holds every tensor of the checkpoint `current`
    with the same shape, and a config of the same architecture: for an engine whose own reload
    (vLLM's) would find out halfway."""
    current, new = Path(current), Path(new)
    _check_architecture(new, _architectures(new), _architectures(current))
    _check_tensors(new, _shapes(new), _shapes(current).items())


def _checkpoint_name(name: str) -> str:
    """A parameter's name in a checkpoint of the plain model: PEFT wraps adapted layers, whose own
    weights move to `base_layer`."""
    return name.replace(".base_layer.", ".")


def model_parameters(model: Any, aliases: bool = False) -> dict[str, torch.nn.Parameter]:
    """`model`'s parameters by checkpoint name, PEFT's adapter weights aside; tied weights appear
    once, or under each of their names with `aliases` (`lm_head.weight` and the embeddings, as a
    trainer's state_dict names them)."""
    return {
        _checkpoint_name(n): p
        for n, p in model.named_parameters(remove_duplicate=not aliases)
        if "lora_" not in n
    }


def copy_tensors_in_place(
    parameters: Mapping[str, torch.nn.Parameter], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Each tensor into the parameter of its name, converted to its dtype and device; the caller
    has checked names and shapes."""
    with torch.no_grad():
        for name, tensor in tensors.items():
            parameters[name].copy_(tensor)


def copy_weights_in_place(model: Any, path: str | Path) -> None:
    """Every parameter of `model` (a transformers model, PEFT's adapter weights aside) from the
    safetensors files of the directory `path`, converted to the parameter's dtype and device."""
    path = Path(path)
    _check_architecture(path, _architectures(path), getattr(model.config, "architectures", None))
    tensors: dict[str, torch.Tensor] = _read(path, lambda f, name: f.get_tensor(name))
    parameters = model_parameters(model)
    shapes = {name: tensor.shape for name, tensor in tensors.items()}
    _check_tensors(path, shapes, ((name, parameter.shape) for name, parameter in parameters.items()))
    copy_tensors_in_place(parameters, {name: tensors[name] for name in parameters})
