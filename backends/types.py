"""The values that cross the engine boundary: what loads an engine, what a request asks, what
an engine answers and reports of itself, what a trainer announces, and the memory of a GPU that a
composed model's two engines share. Arrays are numpy, never per-float objects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Temperatures below this sample greedily, as in vLLM (its _SAMPLING_EPS): logits divided by a
# subnormal temperature overflow to infinities, and the sampler's probabilities to NaN.
GREEDY_BELOW = 1e-5


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


@dataclass(frozen=True)
class EngineConfig:
    """What an engine needs to load a model."""

    model: str  # a local Hugging Face directory, or a built-in name such as "smollm2-135m"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    max_model_len: int | None = None  # None: the model's own context length
    max_lora_rank: int = 0  # largest LoRA rank to expect; 0: no adapters will be loaded
    options: Mapping[str, Any] = field(default_factory=dict)  # backend-specific


@dataclass(frozen=True)
class ModelInfo:
    """What an engine's loaded model is: the facts the gateway reads of it."""

    tokenizer: Any  # a Hugging Face (fast) tokenizer
    vocab_size: int  # width of the logits; may exceed len(tokenizer)
    eos_token_ids: frozenset[int]
    max_model_len: int
    path: str  # where the weights were loaded from (the last weights loaded in place)
    dtype: str  # the dtype computations run in, e.g. "float32"


def resolve_auto_dtype(dtype: str, on_gpu: bool) -> str:
    """The dtype an engine computes in for the `dtype` setting, the same rule for every engine:
    `auto` is float32 on a CPU (exact numbers) and bfloat16 on a GPU (fast); others are themselves."""
    if dtype == "auto":
        return "bfloat16" if on_gpu else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return dtype


GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "lark")


@dataclass(frozen=True)
class Grammar:
    """What generated text must match, as text: a JSON schema (JSON), a regular expression (the
    whole output matches it), or a context-free grammar in EBNF (GBNF: `root ::= ...`, as
    llama.cpp, xgrammar and SGLang spell it) or in Lark. Equal grammars are equal values, so
    compiled grammars are kept by content."""

    kind: str  # one of GRAMMAR_KINDS
    source: str
    # what the engine's StructuredOutputs.check compiled it into, which its generation uses
    compiled: Any = field(default=None, compare=False, repr=False)


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
    grammar: Grammar | None = None  # tokens outside it are never sampled
    # vLLM's and SGLang's controls beyond OpenAI's (backends/token_controls.py), each off by default
    top_k: int = 0  # only the k most likely tokens (0: all)
    min_p: float = 0.0  # only tokens at least this fraction of the most likely one's probability
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: / above 0, * below
    min_tokens: int = 0  # end-of-sequence and stop tokens are never sampled before this many
    ignore_eos: bool = False  # end-of-sequence ends nothing (it may still be sampled)
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end the stream like end-of-sequence
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output never completes
    allowed_token_ids: tuple[int, ...] | None = None  # the only tokens sampled
    # False: the caller reads no token's logprob, so an engine may skip computing them (NaN).
    logprobs: bool = True
    # The caller takes tokens this many at a time (a response sent whole), so an engine whose
    # tokens cross processes may hand them over in bursts of up to this many; 1: each as it comes.
    stream_interval: int = 1

    def ending_tokens(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end the stream: the stop tokens, and end-of-sequence unless `ignore_eos`."""
        return self.stop_token_ids | (frozenset() if self.ignore_eos else eos_token_ids)

    def __post_init__(self) -> None:
        # Near-zero temperatures are greedy, so every engine, vLLM included, samples them alike.
        # top_k 1 keeps only the most likely token: greedy whatever the temperature.
        if self.temperature < GREEDY_BELOW or self.top_k == 1:
            object.__setattr__(self, "temperature", 0.0)


@dataclass(frozen=True)
class TokenStep:
    """One generated token.

    `logprob` and the alternatives come from the model's raw distribution (log_softmax of the
    logits), before temperature, top_p, penalties, logit_bias or a grammar's mask, as vLLM reports
    them by default (vLLM's and SGLang's engines report theirs: docs/api.md). NaN where the
    request's `SamplingParams.logprobs` is False and the engine skipped it.
    """

    token_id: int
    logprob: float
    top_ids: np.ndarray  # [k] int64, most likely first
    top_logprobs: np.ndarray  # [k] float32
    finish_reason: str | None  # "stop" (end-of-sequence token), "length" (max_tokens), or None


@dataclass
class PassStats:
    """Counters of an engine's shared passes (backends/step_scheduler.py): where its concurrent
    dense calls and generation steps are merged."""

    passes: int = 0  # passes that computed their rows (a failed one's are retried one by one)
    submissions: int = 0  # dense calls and generation steps served
    rows: int = 0  # rows computed, identical rows of one pass once
    largest: int = 0  # most submissions in one pass


@dataclass(frozen=True)
class EngineStatus:
    """How an engine is doing, as `Engine.status()` reads it now: what the gateway reports
    (/health, /metrics, /v1/models/{model}/stats), never what it serves by."""

    # False once the engine can serve nothing more: its library's engine or server stopped, or a
    # composed model's engines hold different weights
    healthy: bool = True
    # a copy of its own scheduler's counters, where it merges concurrent calls into shared passes
    # itself; None where its library's scheduler does, or nothing does
    pass_stats: PassStats | None = None
    # prompt tokens of dense rows: (whose keys/values came from its prefix cache, run through the
    # model), where it keeps prefixes itself; None otherwise
    prefill_tokens: tuple[int, int] | None = None


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory, in bytes: `free` and `total` as torch.cuda.mem_get_info reads them (every
    process's use), `dense` what a composed model's dense engine holds (this process's allocator),
    about what its generation engine's weights will take; other processes may hold the rest."""

    free: int
    total: int
    dense: int


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens 1..T-1, each given the tokens before it."""

    token_logprobs: np.ndarray  # [T-1] float32
    top_ids: np.ndarray  # [T-1, k] int64
    top_logprobs: np.ndarray  # [T-1, k] float32
