"""Configuration: a TOML file, overridden by environment variables, overridden by CLI flags.

    host = "0.0.0.0"
    port = 8000
    api_keys_file = "/secrets/api-keys"   # `[name:]sha256:<hex>` per line; unset: no auth
    admin_key = "..."              # the adapter endpoints' key (plain, or a sha256: entry)
    metrics_public = true          # /metrics without a key
    shutdown_grace_s = 30          # after SIGTERM: finish in-flight requests this long
    shared_memory = true           # write dense answers into same-host clients' memory when asked
    local_socket = true            # those clients may then ask over a Unix socket, not HTTP
    trusted_weight_sync = false    # a trainer's weight-sync calls without the admin key
    open_flush_cache = false       # /flush_cache for every key, not only the admin key
    weight_sync_timeout_s = 300    # joining a trainer's collective, each update's transfer
    weight_sync_max_pending_joins = 8  # joins still trying, given up on or not; 400 beyond

    [[models]]
    name = "smollm2-135m"          # the name clients put in `model`
    model = "smollm2-135m"         # a local Hugging Face directory or a built-in model
    backend = "transformers"
    dtype = "auto"
    device = "auto"
    max_model_len = 2048
    adapters = {lora_1 = "/adapters/lora_1"}   # served as "smollm2-135m:lora_1"
    adapters_root = "/adapters"    # run-time loads (admin endpoints) must lie inside it
    weights_root = "/checkpoints"  # /update_weights_from_disk must read inside it; unset: off
    max_batch_rows = 256           # distinct dense rows per engine call
    chat_template = "smollm2-tools"  # shipped, "tokenizer" (the model's own), or a file in the root
    chat_templates_root = "/templates"  # where chat_template files may be read from; unset: none
    tool_call_format = "hermes"    # or llama3_json, mistral; unset: read off the chat template
    options = {}                   # backend-specific (with dense_backend: the generation engine's)
    dense_backend = "self"         # or "transformers": it computes the dense rows, `backend` generates
    dense_options = {}             # the dense engine's own options

    [cache]
    redis_url = "redis://localhost:6379/0"   # unset: in-process LRU of memory_bytes
    ttl_s = 604800

    [limits]                       # all enforced with a 4xx in OpenAI's error format
    max_body_bytes = 67108864      # 413 beyond
    max_non_dense_body_bytes = 4194304  # every other route's bodies; 413 beyond
    max_text_chars = 131072        # characters per text; unset: 16 x the model's max_model_len
    max_streams = 256              # open streamed responses; 429 beyond
    max_in_flight_per_key = 0      # 0: unlimited; 429 + Retry-After beyond
    rows_per_minute_per_key = 0    # dense rows; 0: unlimited; 429 + Retry-After beyond
    max_logprob_entries = 4194304  # logprobs one answer may carry; 400 beyond, before any work
    max_answer_bytes = 2147483648  # dense answers not yet read by their clients, server-wide; 429 beyond
    write_stall_timeout_s = 30     # a client that reads none of its answer this long is disconnected
    header_timeout_s = 15          # a request head not complete this long: 408, connection closed
    max_head_bytes = 65536         # request line and headers; 431 beyond, connection closed
    body_timeout_s = 60            # a body (or local socket frame) not whole this long after its head: 408
    max_unfinished_body_bytes = 536870912  # bodies not yet whole, server-wide; 429 beyond
    local_idle_timeout_s = 300     # a local socket connection with nothing running this long: closed
    max_local_connections = 1024   # local socket connections open at once; beyond: a 429 frame, closed
    max_local_in_flight = 64       # a local socket connection's requests at once; it reads no more beyond
    decode_worker_bytes = 262144   # bodies this large or larger are decoded in a worker process; 0: never
    decode_workers = 1             # such worker processes; bodies wait for a free one
    decode_queue = 4               # bodies waiting for a decode worker; 429 beyond
    weights_update_wait_s = 30     # an update from disk (an adapter unload) waits this long for its requests; 429 beyond

Environment: LOGPROB_GATEWAY_CONFIG, _HOST, _PORT, _MODEL, _BACKEND, _SERVED_MODEL_NAME, _DTYPE,
_DEVICE, _MAX_MODEL_LEN, _LOG_LEVEL, _REDIS_URL, _CACHE (false: no cache), _ADMIN_KEY,
_API_KEYS (comma-separated entries), _API_KEYS_FILE, _METRICS_PUBLIC, _SHUTDOWN_GRACE_S,
_SHARED_MEMORY, _TRUSTED_WEIGHT_SYNC, _WEIGHT_SYNC_TIMEOUT_S, _OPEN_FLUSH_CACHE,
_WEIGHTS_ROOT, _CHAT_TEMPLATE, _CHAT_TEMPLATES_ROOT, _TOOL_CALL_FORMAT.
A model given by flag or environment replaces the file's model list.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from backends.builtin_models import DEFAULT_MODEL
from backends.registry import BACKEND_NAMES, DENSE_BACKEND_NAMES, SELF, composed_config
from backends.types import EngineConfig
from gateway.openai.tool_formats import TOOL_FORMATS

ENV_PREFIX = "LOGPROB_GATEWAY_"


class ConfigError(ValueError):
    """The configuration is invalid; the message is one line fit for the terminal."""


class ModelSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str = DEFAULT_MODEL
    name: str | None = None  # default: the built-in name or the directory's name
    backend: str = "transformers"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    max_model_len: Annotated[int, msgspec.Meta(gt=0)] | None = None
    max_batch_rows: Annotated[int, msgspec.Meta(gt=0)] = 256  # distinct rows per engine call
    adapters: dict[str, str] = {}  # LoRA adapters loaded at start: name -> PEFT directory
    adapters_root: str | None = None  # run-time loads must lie inside it; None: run-time loads off
    max_lora_rank: Annotated[int, msgspec.Meta(gt=0)] = 64
    weights_root: str | None = None  # run-time weight loads must lie inside it; None: they are off
    options: dict[str, Any] = {}  # the engine's; with a dense_backend, the generation engine's
    # "self": the backend's engine computes everything; a backend of DENSE_BACKEND_NAMES: that
    # engine, loaded from the same weights, computes dense rows and prompt scores (backends/composed/)
    dense_backend: str = SELF
    dense_options: dict[str, Any] = {}  # the dense engine's options
    # the template chat requests are rendered with (gateway/models/chat_template.py): a shipped
    # template's name, "tokenizer" (the model's own), or a Jinja file inside chat_templates_root;
    # None: the built-in model's shipped template where it has one, else the model's own
    chat_template: str | None = None
    chat_templates_root: str | None = None  # template files must lie inside it; None: no files
    tool_call_format: str | None = None  # a name of TOOL_FORMATS; None: read off the chat template

    @property
    def served_name(self) -> str:
        return self.name or Path(self.model.rstrip("/")).name

    @property
    def engines(self) -> str:
        """The backend, or "generation+dense" for a composed model: in logs and fingerprints."""
        return self.backend if self.dense_backend == SELF else f"{self.backend}+{self.dense_backend}"

    def engine_config(self) -> EngineConfig:
        config = EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            max_lora_rank=self.max_lora_rank if self.adapters or self.adapters_root else 0,
            options=self.options,
        )
        if self.dense_backend == SELF:
            return config
        return composed_config(config, self.backend, self.dense_backend, self.dense_options)

    def check(self) -> None:
        """ConfigError for what no model can be: an unknown backend, a dense_backend that cannot
        compute dense rows, a name that holds ':'."""
        name = self.served_name
        if self.backend not in BACKEND_NAMES:
            raise ConfigError(
                f"model {name!r}: unknown backend {self.backend!r}; choose one of: {', '.join(BACKEND_NAMES)}"
            )
        if self.dense_backend not in DENSE_BACKEND_NAMES:
            what = (
                f"dense_backend {self.dense_backend!r} cannot compute a composed model's dense rows"
                if self.dense_backend in BACKEND_NAMES
                else f"unknown dense_backend {self.dense_backend!r}"
            )
            raise ConfigError(f"model {name!r}: {what}; choose one of: {', '.join(DENSE_BACKEND_NAMES)}")
        if self.dense_options and self.dense_backend == SELF:
            raise ConfigError(f"model {name!r}: dense_options without a dense_backend; put them in options")
        if ":" in name:
            raise ConfigError(f"model name {name!r} must not contain ':' (it selects adapters)")
        if self.tool_call_format is not None and self.tool_call_format not in TOOL_FORMATS:
            raise ConfigError(
                f"model {name!r}: unknown tool_call_format {self.tool_call_format!r}; "
                f"choose one of: {', '.join(TOOL_FORMATS)}"
            )
        for key in ("chat_template", "chat_templates_root"):  # "" would read as the working directory
            if getattr(self, key) == "":
                raise ConfigError(f"model {name!r}: {key} is empty; leave it out for the default")


class Limits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_n: Annotated[int, msgspec.Meta(gt=0)] = 16
    max_prompts: Annotated[int, msgspec.Meta(gt=0)] = 64  # prompts in one completion request
    max_top_logprobs: Annotated[int, msgspec.Meta(ge=0)] = 20
    max_stop: Annotated[int, msgspec.Meta(ge=0)] = 4
    # vLLM's `bad_words` per request: each word's token sequences are checked at every step
    max_bad_words: Annotated[int, msgspec.Meta(ge=0)] = 128
    max_tokens: Annotated[int, msgspec.Meta(gt=0)] = 4096  # tokens generated per choice
    max_rows: Annotated[int, msgspec.Meta(gt=0)] = 1024  # rows in one next_token_logprobs request
    # characters of one text (a prompt, a conversation, a dense input), refused before tokenizing;
    # None: 16 per token of the model's max_model_len (gateway/prompts.py says why)
    max_text_chars: Annotated[int, msgspec.Meta(gt=0)] | None = None
    max_body_bytes: Annotated[int, msgspec.Meta(gt=0)] = 64 * 2**20  # request bodies (413 beyond)
    # bodies of every route but the dense one, which a valid request has decoded on the event loop
    # (msgspec holds the GIL): this bounds that decode (413 beyond)
    max_non_dense_body_bytes: Annotated[int, msgspec.Meta(gt=0)] = 4 * 2**20
    max_streams: Annotated[int, msgspec.Meta(gt=0)] = 256  # open streamed responses, server-wide
    max_in_flight_per_key: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: unlimited
    rows_per_minute_per_key: Annotated[int, msgspec.Meta(ge=0)] = 0  # dense rows; 0: unlimited
    # logprob values in one answer (tokens' own, top logprobs, named token ids), counted before any work
    max_logprob_entries: Annotated[int, msgspec.Meta(gt=0)] = 4 * 2**20
    # a request's grammar (response_format, SGLang's regex/json_schema/ebnf) compiled within this,
    # or refused (400); compiled grammars are kept by content, so a grammar pays it once
    grammar_compile_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # grammar compile worker processes per model, and grammars waiting for one (429 beyond)
    grammar_compile_workers: Annotated[int, msgspec.Meta(gt=0, le=64)] = 2
    grammar_compile_queue: Annotated[int, msgspec.Meta(ge=0)] = 8
    # Dense answers' bytes held at once, server-wide, from before their rows are computed until
    # their clients have read them (429 beyond; 400 for one answer larger than all of it).
    max_answer_bytes: Annotated[int, msgspec.Meta(gt=0)] = 2 * 2**30
    write_stall_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0  # a client reading nothing: cut
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 15.0  # request line + headers (408 beyond)
    max_head_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 2**10  # request line + headers (431 beyond)
    # a request body, or a local socket frame, complete this long after its head began (408 beyond)
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    # bytes of request bodies received and not yet whole, all connections together (429 beyond)
    max_unfinished_body_bytes: Annotated[int, msgspec.Meta(gt=0)] = 512 * 2**20
    # a local socket connection with nothing running and nothing sent this long is closed
    local_idle_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    # local socket connections open at once (each a file descriptor); beyond, a 429 frame and closed
    max_local_connections: Annotated[int, msgspec.Meta(gt=0)] = 1024
    # requests of one local socket connection running at once; it reads no more frames until one ends
    max_local_in_flight: Annotated[int, msgspec.Meta(gt=0)] = 64
    # bodies (and local socket frames) of this many bytes or more are decoded in a worker process,
    # off the event loop (msgspec holds the GIL); 0: every body on the loop
    decode_worker_bytes: Annotated[int, msgspec.Meta(ge=0)] = 256 * 2**10
    # such worker processes; larger bodies wait for a free one (each peaks at ~5x its body's bytes)
    decode_workers: Annotated[int, msgspec.Meta(gt=0, le=64)] = 1
    decode_queue: Annotated[int, msgspec.Meta(ge=0)] = 4  # such bodies waiting for a worker (429 beyond)
    # An update from disk waits this long for the requests reading the old weights, holding new
    # ones back meanwhile; then it is refused (429) and they go on. Pause generation first
    # (/pause_generation, retract or in_place) to update under long streams. An adapter unload
    # waits as long for the requests using the adapter.
    weights_update_wait_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0


class CacheSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Output cache of dense rows: Redis when `redis_url` is set, else an in-process LRU."""

    enabled: bool = True
    redis_url: str | None = None  # e.g. redis://cache:6379/0; shared by every replica
    ttl_s: Annotated[int, msgspec.Meta(gt=0)] = 7 * 24 * 3600
    memory_bytes: Annotated[int, msgspec.Meta(ge=0)] = 256 * 2**20  # in-process LRU size
    # Keys of rows written straight into clients' memory, remembered so that such a row is copied
    # for the cache only once it is asked again (0: copied the first time)
    admission_bytes: Annotated[int, msgspec.Meta(ge=0)] = 32 * 2**20
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 0.25  # per Redis call
    retry_after_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0  # skip Redis this long after a failure
    namespace: str = "lpg"


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    admin_key: str | None = None  # enables /v1/load_lora_adapter and /v1/unload_lora_adapter
    # API keys as `[name:]sha256:<hex>` entries (gateway/access.py); none configured: no auth
    api_keys: list[str] = []
    api_keys_file: str | None = None  # one entry per line (a mounted secret)
    metrics_public: bool = True  # /metrics without a key (for scrapers); /health never needs one
    shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0  # drain time after SIGTERM
    # Dense matrices written into a same-host client's memfd when its request names one
    # (gateway/dense/shared_memory.py); off: always in the body.
    shared_memory: bool = True
    # Clients whose answers go into their memory may ask over a Unix socket instead of HTTP
    # (gateway/dense/local_socket.py); needs shared_memory.
    local_socket: bool = True
    # A gateway dedicated to one trainer: the weight-sync endpoints (/init_weights_update_group,
    # /update_weights_from_distributed, /pause_generation, ...) without the admin key, which
    # TorchRL never sends (gateway/weights/group_routes.py).
    trusted_weight_sync: bool = False
    weight_sync_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0  # joining, each update's transfer
    # joins of a trainer's collective still trying, given up on or not (a silent peer holds one)
    weight_sync_max_pending_joins: Annotated[int, msgspec.Meta(gt=0)] = 8
    # /flush_cache empties a shared service's caches: the admin key's unless this opens it to every key
    open_flush_cache: bool = False
    # threads of the engines' math on the CPU (backends/cpu_threads.py); 0: OMP_NUM_THREADS if
    # set, else half the CPUs this process may run on, the other half left to its clients
    threads: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    models: list[ModelSettings] = msgspec.field(default_factory=lambda: [ModelSettings()])
    limits: Limits = msgspec.field(default_factory=Limits)
    cache: CacheSettings = msgspec.field(default_factory=CacheSettings)

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("at least one model must be configured")
        names = [m.served_name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"model names must be unique; repeated: {', '.join(duplicates)}")
        for m in self.models:
            m.check()


_MODEL_KEYS = (
    "model",
    "backend",
    "dense_backend",
    "name",
    "dtype",
    "device",
    "max_model_len",
    "weights_root",
    "chat_template",
    "chat_templates_root",
    "tool_call_format",
)
_ENV_KEYS = {
    "HOST": "host",
    "PORT": "port",
    "LOG_LEVEL": "log_level",
    "MODEL": "model",
    "BACKEND": "backend",
    "DENSE_BACKEND": "dense_backend",
    "SERVED_MODEL_NAME": "name",
    "DTYPE": "dtype",
    "DEVICE": "device",
    "MAX_MODEL_LEN": "max_model_len",
    "WEIGHTS_ROOT": "weights_root",
    "CHAT_TEMPLATE": "chat_template",
    "CHAT_TEMPLATES_ROOT": "chat_templates_root",
    "TOOL_CALL_FORMAT": "tool_call_format",
    "REDIS_URL": "redis_url",
    "CACHE": "cache_enabled",
    "ADMIN_KEY": "admin_key",
    "API_KEYS": "api_keys",  # comma-separated entries
    "API_KEYS_FILE": "api_keys_file",
    "METRICS_PUBLIC": "metrics_public",
    "SHUTDOWN_GRACE_S": "shutdown_grace_s",
    "SHARED_MEMORY": "shared_memory",
    "LOCAL_SOCKET": "local_socket",
    "TRUSTED_WEIGHT_SYNC": "trusted_weight_sync",
    "WEIGHT_SYNC_TIMEOUT_S": "weight_sync_timeout_s",
    "OPEN_FLUSH_CACHE": "open_flush_cache",
    "THREADS": "threads",
}
_CACHE_KEYS = {"redis_url": "redis_url", "cache_enabled": "enabled"}


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    found = {key: environ[ENV_PREFIX + var] for var, key in _ENV_KEYS.items() if ENV_PREFIX + var in environ}
    if "api_keys" in found:
        found["api_keys"] = [entry for entry in found["api_keys"].split(",") if entry.strip()]
    return found


def load_settings(
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build settings from file < environment < overrides (CLI flags; None values are ignored)."""
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG")
    raw: dict[str, Any] = {}
    if config_file:
        try:
            raw = tomllib.loads(Path(config_file).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {config_file}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_file} is not valid TOML: {exc}") from None
    layered = {**env_overrides(environ), **{k: v for k, v in (overrides or {}).items() if v is not None}}
    model_fields = {k: layered.pop(k) for k in _MODEL_KEYS if k in layered}
    cache_fields = {_CACHE_KEYS[k]: layered.pop(k) for k in list(_CACHE_KEYS) if k in layered}
    # A malformed table in the file is left as it is, for the validation below to report.
    if cache_fields and isinstance(raw.get("cache", {}), dict):
        raw["cache"] = {**raw.get("cache", {}), **cache_fields}
    models = raw.get("models", [{}])
    if "model" in model_fields:
        raw["models"] = [model_fields]
    elif model_fields and isinstance(models, list) and all(isinstance(m, dict) for m in models):
        # backend/dtype/... without a model: apply to every configured model
        raw["models"] = [{**m, **model_fields} for m in models]
    raw.update(layered)
    try:
        # strict=False: environment values arrive as strings ("8000")
        return msgspec.convert(raw, Settings, strict=False)
    except msgspec.ValidationError as exc:
        where = f" in {config_file}" if config_file else ""
        raise ConfigError(f"invalid configuration{where}: {exc}") from None
