"""A Python client of the gateway that drops into genlm in place of a local model.

`AsyncGatewayLM` implements genlm-backend's (0.3) `AsyncLM` interface (next_token_logprobs, the
batch, sync and uncached variants, all with a per-call `lora_name`; set_lora, clear_lora,
add_new_lora, remove_lora; byte_vocab, str_vocab, tokenizer, clear_cache, sample, batch_sample)
over HTTP, and passes `isinstance(lm, AsyncLM)` where genlm-backend is installed. Concurrent
`next_token_logprobs` calls are merged into one request, the way genlm's local backends
auto-batch. The answer is one float32 matrix (dense_requests.py): written by a gateway on the
same host straight into this process's memory (shared_memory.py), else one MessagePack body in
one buffer. Requests go through one `httpx.AsyncClient`; for plain-http URLs without a proxy
its transport is socket_transport.py's, which reads each body off the socket into that buffer
(and hands answers it does not read to httpx's own transport), else httpx's own. Every row
returned is a view of the buffer, never a copy, and shared with the client's cache, as genlm's
own backends share rows with theirs: do not write into them. Errors: the gateway's error answers
raise `GatewayClientError`, network failures httpx's exceptions. Needs only httpx, msgspec and
numpy; returns torch tensors when torch is installed (like genlm), numpy arrays otherwise.

    from logprob_gateway_client import AsyncGatewayLM
    from genlm.control import PromptedLLM

    llm = AsyncGatewayLM("http://gpu-node:8000", "smollm2-135m")
    potential = PromptedLLM(llm)
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import Sequence
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from logprob_gateway_client.buffer_lru import BufferLRU
from logprob_gateway_client.dense_requests import DenseRequests, http_timeout
from logprob_gateway_client.encoding import Dtype
from logprob_gateway_client.lora import LoraManagement
from logprob_gateway_client.sampling import HAS_TORCH, Sampling
from logprob_gateway_client.wire import GatewayClientError, RowKey, pack_ids, raise_for_error

__all__ = ["AsyncGatewayLM", "GatewayClientError"]

MSGPACK = "application/msgpack"
ROUTING_KEY_HEADER = "x-smg-routing-key"  # SGLang's model gateway's
GENLM_EXTRA = (
    'llm.tokenizer needs transformers, in the genlm extra: pip install "logprob-gateway-client[genlm]" '
    '(from a clone of the gateway: pip install "./client[genlm]")'
)


def _genlm_tokens(byte_vocab: list[bytes]) -> list[bytes]:
    """genlm's Token objects (bytes that know their id) when genlm is installed, else plain bytes."""
    try:
        from genlm.backend.tokenization.token import Token
    except ImportError:
        return byte_vocab
    return [Token(token_id=i, byte_string=b) for i, b in enumerate(byte_vocab)]


@cache
def _register_with_genlm() -> None:
    """Makes instances pass `isinstance(lm, genlm.backend.llm.AsyncLM)` where genlm-backend is
    installed; run by the first constructor, as importing genlm loads torch and transformers."""
    try:
        from genlm.backend.llm import AsyncLM
    except ImportError:
        return
    AsyncLM.register(AsyncGatewayLM)


def _as_output(array: np.ndarray) -> Any:
    if HAS_TORCH:
        import torch

        return torch.from_numpy(array)
    return array


class AsyncGatewayLM(DenseRequests, LoraManagement, Sampling):
    """genlm's `AsyncLM`, served remotely. `model` may name an adapter: "base:adapter";
    `set_lora`/`clear_lora` change it. `admin_key` (the gateway's) enables `add_new_lora` and
    `remove_lora`.

    `shared_memory`: None (default) asks the gateway to write large answers into this process's
    memory while it does so (it can when it runs on this host); False never; True also, and
    fails where the platform has no memfd (Linux only).

    `server_cache`: False asks the gateway to compute every row now, its output cache neither read
    nor written (to measure the engine; `clear_cache` empties only this client's rows).

    `routing_key`: what a router in front of several gateways keeps this instance's calls
    together by (SGLang's model gateway reads it from `x-smg-routing-key`), so that the prefixes
    of a job's calls are computed once, on one replica. Default: a key of this instance's own."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        dtype: Dtype = "float32",
        timeout: float = 300.0,
        cache_size: int = 1024,
        cache_bytes: int = 512 << 20,
        max_rows_per_request: int = 1024,
        shared_memory: bool | None = None,
        local_socket: bool = True,
        admin_key: str | None = None,
        routing_key: str | None = None,
        server_cache: bool = True,
    ) -> None:
        _register_with_genlm()
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.dtype: Dtype = dtype
        self.max_rows_per_request = max_rows_per_request
        self.server_cache = server_cache
        # identity: a proxy that compressed answers would cost a decompression of every step
        self._headers = {"Accept": MSGPACK, "Content-Type": MSGPACK, "Accept-Encoding": "identity"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.routing_key = routing_key or uuid.uuid4().hex
        self._headers[ROUTING_KEY_HEADER] = self.routing_key
        self._admin_key = admin_key
        self._sync = httpx.Client(
            base_url=self.base_url, headers=self._headers, timeout=http_timeout(timeout)
        )
        # Rows seen, by (model, ids); sized in rows and in the bytes of the matrices they keep alive.
        self._cache = BufferLRU(cache_size, cache_bytes)
        self._pending: dict[RowKey, asyncio.Future[np.ndarray]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._open_connections(timeout, api_key, shared_memory, local_socket, self._cache)
        vocab = self._get(f"/v1/models/{self._base_model}/vocabulary")
        self.vocab_size: int = vocab["vocab_size"]
        self.byte_vocab: list[bytes] = _genlm_tokens(vocab["tokens"])
        self.eos_token_ids: list[int] = vocab["eos_token_ids"]
        self.bos_token_id: int | None = vocab["bos_token_id"]

    # -- vocabulary and tokenizer --------------------------------------------------------------

    def _get(self, path: str) -> Any:
        """A model's facts (vocabulary, tokenizer files) from the gateway; behind a router that does
        not forward them (SGLang's model gateway), from the first worker that its `/workers` lists
        for the model, whose facts every replica shares."""
        response = self._sync.get(path)
        if response.status_code == 404 and not path.startswith("/workers"):
            worker = self._worker_url()
            if worker is not None:
                response = self._sync.get(worker + path)
        raise_for_error(response)
        return (
            msgspec.msgpack.decode(response.content)
            if MSGPACK in response.headers.get("content-type", "")
            else response.json()
        )

    def _worker_url(self) -> str | None:
        """A worker of the router at `base_url` serving this model, None where `base_url` is no
        router (its /workers is not SGLang's model gateway's)."""
        response = self._sync.get("/workers")
        if response.status_code != 200:
            return None
        try:
            workers = response.json()["workers"]
        except (ValueError, KeyError, TypeError):
            return None
        for worker in workers:
            if worker.get("model_id") == self._base_model and worker.get("url"):
                self._route_through_router()  # dense rows through the router's /generate
                return str(worker["url"]).rstrip("/")
        return None

    @cached_property
    def tokenizer(self) -> Any:
        """The model's exact Hugging Face tokenizer, rebuilt from the gateway's files (needs transformers)."""
        try:
            from transformers import AutoTokenizer
        except ModuleNotFoundError as missing:
            raise ModuleNotFoundError(GENLM_EXTRA, name=missing.name) from missing

        files = self._get(f"/v1/models/{self._base_model}/tokenizer")["files"]
        with tempfile.TemporaryDirectory() as directory:
            for name, text in files.items():
                (Path(directory) / Path(name).name).write_text(text)
            return AutoTokenizer.from_pretrained(directory)

    @cached_property
    def str_vocab(self) -> list[str]:
        """Each token as text: its bytes as UTF-8, or the tokenizer's spelling when they are not."""
        out = []
        for token_id, raw in enumerate(self.byte_vocab):
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(self.tokenizer.convert_ids_to_tokens(token_id))
        return out

    def _model_for(self, lora_name: str | None) -> str:
        """A call's own adapter, else `model` (which `set_lora`/`clear_lora` choose)."""
        return self.model if lora_name is None else f"{self._base_model}:{lora_name}"

    # -- dense rows ------------------------------------------------------------------------------

    async def next_token_logprobs(self, token_ids: Sequence[int], lora_name: str | None = None) -> Any:
        """log_softmax over the whole vocabulary after `token_ids`; concurrent calls share one request."""
        return _as_output(await self._row((self._model_for(lora_name), pack_ids(token_ids))))

    async def _row(self, key: RowKey) -> np.ndarray:
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        future = self._pending.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._pending[key] = future
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush())
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        # Let every coroutine that is about to ask for a row (e.g. all particles of one step) ask.
        for _ in range(3):
            await asyncio.sleep(0)
        while self._pending:
            pending, self._pending = self._pending, {}
            by_model: dict[str, list[RowKey]] = {}
            for key in pending:
                by_model.setdefault(key[0], []).append(key)
            await asyncio.gather(*(self._fetch_into(keys, pending) for keys in by_model.values()))

    async def _fetch_into(
        self, keys: list[RowKey], futures: dict[RowKey, asyncio.Future[np.ndarray]]
    ) -> None:
        try:
            values = await self._fetch(keys[0][0], [packed for _, packed in keys])
        except Exception as exc:
            for key in keys:
                if not futures[key].done():
                    futures[key].set_exception(exc)
            return
        self._cache.put_rows(keys, values)
        for key, value in zip(keys, values, strict=True):
            if not futures[key].done():
                futures[key].set_result(value)

    def next_token_logprobs_sync(self, token_ids: Sequence[int], lora_name: str | None = None) -> Any:
        return self.batch_next_token_logprobs_sync([token_ids], lora_name=lora_name)[0]

    def next_token_logprobs_uncached(self, token_ids: Sequence[int], lora_name: str | None = None) -> Any:
        """The row for `token_ids` asked of the gateway now: the client's row cache is neither read
        nor filled (genlm's uncached call). The gateway's own output cache may still answer it,
        with the same numbers, as a row does not depend on when it is computed."""
        return _as_output(self._fetch_sync(self._model_for(lora_name), [pack_ids(token_ids)])[0])

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> Any:
        model = self._model_for(lora_name)
        keys = [(model, pack_ids(t)) for t in token_ids_list]
        positions: dict[RowKey, int] = {}
        for key in keys:
            positions.setdefault(key, len(positions))
        if self._cache.isdisjoint(positions) and self._pending.keys().isdisjoint(positions):
            # All new (an SMC step): one request, and its answer as it is. Rows that repeat
            # (particles that resampling duplicated) are asked for as they are when the gateway
            # writes into this process's memory: it copies them on its side (a GPU engine on its
            # device); over a socket the distinct rows travel once and are gathered here.
            if len(positions) == len(keys) or self._ask_shared_memory:
                matrix = await self._fetch(model, [packed for _, packed in keys])
                self._cache.put_rows(keys, matrix)
                return _as_output(matrix)
            matrix = await self._fetch(model, [packed for _, packed in positions])
            self._cache.put_rows(list(positions), matrix)
            return _as_output(matrix[[positions[k] for k in keys]])
        rows = await asyncio.gather(*(self._row(key) for key in keys))
        return _as_output(np.stack(rows))

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> Any:
        model = self._model_for(lora_name)
        keys = [(model, pack_ids(t)) for t in token_ids_list]
        # Rows taken from the cache before fetching: storing the fetched ones may evict them.
        found = {k: row for k in dict.fromkeys(keys) if (row := self._cache.get(k)) is not None}
        missing = [k for k in dict.fromkeys(keys) if k not in found]
        if not found and self._ask_shared_memory:  # all new, repeats copied by the gateway
            matrix = self._fetch_sync(model, [packed for _, packed in keys])
            self._cache.put_rows(keys, matrix)
            return _as_output(matrix)
        if missing:
            matrix = self._fetch_sync(model, [packed for _, packed in missing])
            self._cache.put_rows(missing, matrix)
            if missing == keys:
                return _as_output(matrix)
            found.update(zip(missing, matrix, strict=True))
        return _as_output(np.stack([found[k] for k in keys]))

    def clear_cache(self) -> None:
        self._cache.clear()
        if self._segments is not None:
            self._segments.drop_idle()

    # -- lifecycle -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        await self._close_async()
        self.close()

    def close(self) -> None:
        self._close_connections()
        self._sync.close()

    async def __aenter__(self) -> AsyncGatewayLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> AsyncGatewayLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
