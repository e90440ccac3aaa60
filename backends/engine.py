"""The engine contract: one loaded model, and the capabilities an engine may have.

An engine owns one model (weights + tokenizer). All its methods are async; heavy compute runs
off the event loop (a worker thread or the engine library's own async API). Arrays cross the
boundary as numpy, never as per-float Python objects.

A capability is an object or None, and `engine.<capability> is None` is the one way to ask:

    adapters      Adapters      LoRA adapters loaded and unloaded at run time
    weights       Weights       new weights in place; `.collective`: over a trainer's collective;
                                `.own_tensors` / `.device_tensors`: handed between two engines on
                                one device (a composed model's) with no trip through the host
    host_memory   HostMemory    rows written from the device straight into registered host memory
    prefix_cache  PrefixCache   prefix keys/values kept for reuse, which can be forgotten
    structured_outputs  StructuredOutputs   generation held to a grammar (SamplingParams.grammar)

A capability changes what a request can get (lacking it: a 400, a 501, a copy on the host). What
an engine only reports of itself is one method, `status()` (EngineStatus): whether it is healthy,
and the counters of its own scheduler where it merges concurrent calls into shared passes itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

import numpy as np

from backends.rows import PackedRows
from backends.types import (
    AnnouncedTensor,
    EngineConfig,
    EngineStatus,
    Grammar,
    ModelInfo,
    PromptLogprobs,
    SamplingParams,
    TokenStep,
    WeightsGroup,
)


class Adapters(ABC):
    """PEFT LoRA adapters, loaded under names that requests then give per row."""

    @abstractmethod
    async def load(self, name: str, path: str) -> None:
        """Load the adapter in directory `path` as `name`; AdapterError if it does not fit the model."""

    @abstractmethod
    async def unload(self, name: str) -> None:
        """AdapterError if no adapter of that name is loaded."""


class Collective(ABC):
    """New weights broadcast by a trainer (rank 0) over a collective the engine joins."""

    @abstractmethod
    async def join(self, group: WeightsGroup) -> None:
        """Join `group` as `group.rank`; returns once every rank has joined, within
        `group.timeout_s`. WeightsError: the name is taken, or joining failed (nothing joined)."""

    @abstractmethod
    async def receive(self, group_name: str, tensors: Sequence[AnnouncedTensor]) -> None:
        """Receive `tensors`, broadcast from rank 0 of the group one after another in this order,
        and load them in place between forward passes, as `Weights.load` does; parameters not
        named keep their weights. The engine takes part in every broadcast even when the
        announcement does not fit the model, then raises WeightsError with nothing changed; a
        failed transfer leaves the group (WeightsError, nothing changed)."""

    @abstractmethod
    async def leave(self, group_name: str) -> None:
        """WeightsError if the engine is in no group of that name."""


class OwnTensors(ABC):
    """The tensors an engine computes with, lent to another engine on the same device."""

    @abstractmethod
    async def named(self, names: Collection[str] | None = None) -> list[tuple[str, Any]]:
        """(checkpoint name, torch tensor) of each parameter named (None: every one, tied weights
        once), the tensors themselves on the engine's device, once every write into them has
        finished; valid until the engine's weights change."""


class DeviceTensors(ABC):
    """New weights given as tensors on the engine's device by another engine there (a composed
    model's dense engine), loaded with no trip through the host or the disk."""

    @abstractmethod
    async def load(self, tensors: Sequence[tuple[str, Any]]) -> None:
        """Load `tensors` ((checkpoint name, torch tensor) on this engine's device) in place, as
        `Weights.load` does; parameters not named keep their weights. The caller leaves the
        tensors unchanged until this returns. WeightsError: the engine refused them."""


class Weights(ABC):
    """New weights of the same architecture, loaded in place between forward passes."""

    collective: Collective | None = None  # None: from disk only
    own_tensors: OwnTensors | None = None  # None: lends none
    device_tensors: DeviceTensors | None = None  # None: takes none
    # `generate` computes a step only when its consumer asks for the next one, so a stream can be
    # held between steps (generation paused) while weights change; engines whose streams run
    # ahead leave this False.
    held_between_steps: bool = False

    @abstractmethod
    async def load(self, path: str) -> None:
        """Load the weights in the Hugging Face directory `path`; WeightsError (nothing changed)
        if they do not fit. Whatever the engine kept of earlier passes (prefix keys/values) is
        dropped."""


class HostMemory(ABC):
    """Host memory the engine's device writes rows into in one copy (page-locked, or registered
    with the device's driver), where pageable memory would take a staging copy more."""

    @abstractmethod
    def register(self, address: int, size: int) -> bool:
        """Make `size` bytes at `address` memory rows can be written into; False if it cannot."""

    @abstractmethod
    def unregister(self, address: int) -> None:
        """Undo `register`; the caller ensures no write into that memory is under way."""

    @abstractmethod
    async def write_rows(
        self,
        rows: PackedRows,
        adapters: Sequence[str | None],
        arrays: Sequence[np.ndarray],
        positions: Sequence[int] | None,
    ) -> None:
        """`Engine.next_token_logprobs` of the distinct `rows`, written from the device into every
        one of `arrays` (float32 [asked rows, vocab]; asked row i is distinct row positions[i]),
        each registered with `register` or from `empty`. Returns once the copies are queued:
        the caller waits for each array with `wait_landed` before reading it, the first array's
        rows landing first."""

    @abstractmethod
    def empty(self, rows: int) -> np.ndarray:
        """float32 [rows, vocab] of the engine's own page-locked memory, uninitialised; it lives
        as long as the array does."""

    @abstractmethod
    def wait_landed(self, array: np.ndarray) -> None:
        """Block until every row written into `array` (an array of a call's `out`) has landed."""


class PrefixCache(ABC):
    """Keys/values of prefixes kept for reuse by later requests."""

    @abstractmethod
    async def flush(self) -> None:
        """Forget every kept prefix; later requests compute them again."""


class StructuredOutputs(ABC):
    """Generation held to a grammar: `generate` samples only tokens the request's
    `SamplingParams.grammar` allows, and ends (end-of-sequence) where it is complete."""

    @abstractmethod
    async def check(
        self, grammar: Grammar, timeout_s: float, workers: int = 2, max_waiting: int = 8
    ) -> Grammar:
        """`grammar` carrying its compiled form (`Grammar.compiled`), which the generation that
        follows uses, so it never compiles again; GrammarError, with the grammar engine's message,
        if `grammar` is invalid, asks for what the engine cannot enforce, crashes the grammar
        engine, or does not compile within `timeout_s` of its compile's start. Compiles run in
        `workers` processes (read at the first check), with at most `max_waiting` grammars waiting
        for one (GrammarBusyError, a GrammarError, beyond). Verdicts are kept by content."""


class Engine(ABC):
    """One loaded model. Token ids given to an engine are already validated (0 <= id < vocab_size)."""

    info: ModelInfo  # the model's facts: tokenizer, vocabulary, context length, dtype, path
    adapters: Adapters | None = None
    weights: Weights | None = None
    host_memory: HostMemory | None = None
    prefix_cache: PrefixCache | None = None
    structured_outputs: StructuredOutputs | None = None

    @classmethod
    @abstractmethod
    def load(cls, config: EngineConfig) -> Engine:
        """Load the model. Blocking; the gateway calls it in a worker thread."""

    @abstractmethod
    async def next_token_logprobs(self, rows: PackedRows, adapters: Sequence[str | None]) -> np.ndarray:
        """log_softmax of the logits after each row: float32 [len(rows), vocab_size]. Row i under
        the LoRA adapter `adapters[i]` (None: the base model); one call may mix them. The rows are
        distinct: callers come through backends/placement.py, which computes repeats once.
        Concurrent calls are the engine's to merge into shared work (its scheduler); a call whose
        caller has gone (cancelled) before its work began is never computed."""

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

    def status(self) -> EngineStatus:
        """How it is doing now. This default, healthy and without passes of its own, fits an engine
        whose work runs in this process within its calls; one whose library's engine or server can
        stop, or that merges concurrent calls into passes of its own, overrides it."""
        return EngineStatus()

    async def aclose(self) -> None:  # noqa: B027 (optional hook)
        """Release the model's resources."""
        return None
