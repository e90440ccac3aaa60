"""A Python client of the gateway that drops into genlm in place of a local model.

`AsyncGatewayLM` implements genlm-backend's `AsyncLM` interface (next_token_logprobs, the batch
and sync variants, byte_vocab, str_vocab, tokenizer, clear_cache, sample) over HTTP. Concurrent
`next_token_logprobs` calls are merged into one request (MessagePack, raw float32 rows), the way
genlm's local backends auto-batch. Needs only httpx, msgspec and numpy; returns torch tensors
when torch is installed (like genlm), numpy arrays otherwise.

    from gateway.client import AsyncGatewayLM
    from genlm.control import PromptedLLM

    llm = AsyncGatewayLM("http://gpu-node:8000", "smollm2-135m")
    potential = PromptedLLM(llm)
"""

from __future__ import annotations

import asyncio
import importlib.util
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from gateway.encoding import Dtype, decode_row

MSGPACK = "application/msgpack"
_HAS_TORCH = importlib.util.find_spec("torch") is not None


class GatewayClientError(RuntimeError):
    """The gateway answered with an error; `status` and the server's message are kept."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        message = msgspec.json.decode(response.content)["error"]["message"]
    except Exception:
        message = response.text
    raise GatewayClientError(response.status_code, message)


def _as_output(array: np.ndarray) -> Any:
    if _HAS_TORCH:
        import torch

        return torch.from_numpy(array)
    return array


class AsyncGatewayLM:
    """genlm's `AsyncLM`, served remotely. `model` may name an adapter: "base:adapter"."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        dtype: Dtype = "float32",
        timeout: float = 300.0,
        cache_size: int = 1024,
        max_rows_per_request: int = 1024,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.dtype: Dtype = dtype
        self.cache_size = cache_size
        self.max_rows_per_request = max_rows_per_request
        self._headers = {"Accept": MSGPACK, "Content-Type": MSGPACK}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = timeout
        self._sync = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=timeout)
        self._async: httpx.AsyncClient | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self._cache: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()
        self._pending: dict[tuple[int, ...], asyncio.Future[np.ndarray]] = {}
        self._flusher: asyncio.Task[None] | None = None
        vocab = self._get(f"/v1/models/{self._base_model}/vocabulary")
        self.vocab_size: int = vocab["vocab_size"]
        self.byte_vocab: list[bytes] = vocab["tokens"]
        self.eos_token_ids: list[int] = vocab["eos_token_ids"]
        self.bos_token_id: int | None = vocab["bos_token_id"]

    # -- vocabulary and tokenizer --------------------------------------------------------------

    @property
    def _base_model(self) -> str:
        return self.model.partition(":")[0]

    def _get(self, path: str) -> Any:
        response = self._sync.get(path)
        _raise_for_error(response)
        return msgspec.msgpack.decode(response.content) if MSGPACK in response.headers.get(
            "content-type", ""
        ) else response.json()

    @cached_property
    def tokenizer(self) -> Any:
        """The model's exact Hugging Face tokenizer, rebuilt from the gateway's files (needs transformers)."""
        from transformers import AutoTokenizer

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

    # -- LoRA: genlm switches adapters globally; here an instance routes to "base:adapter" ------

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        self.model = f"{self._base_model}:{lora_name}"

    def clear_lora(self) -> None:
        self.model = self._base_model

    # -- dense rows ------------------------------------------------------------------------------

    def _request_body(self, rows: Sequence[Sequence[int]]) -> bytes:
        return msgspec.msgpack.encode({"model": self.model, "input": [list(r) for r in rows], "dtype": self.dtype})

    def _decode(self, content: bytes, count: int) -> np.ndarray:
        document = msgspec.msgpack.decode(content)
        out = np.empty((count, document["vocab_size"]), dtype=np.float32)
        for row in document["data"]:
            out[row["index"]] = decode_row(row["logprobs"], self.dtype)
        return out

    def _remember(self, rows: Iterable[tuple[int, ...]], values: np.ndarray) -> None:
        if self.cache_size <= 0:
            return
        for row, value in zip(rows, values, strict=True):
            self._cache[row] = value
            self._cache.move_to_end(row)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _fetch_sync(self, rows: list[tuple[int, ...]]) -> np.ndarray:
        parts = []
        for start in range(0, len(rows), self.max_rows_per_request):
            chunk = rows[start : start + self.max_rows_per_request]
            response = self._sync.post("/v1/next_token_logprobs", content=self._request_body(chunk))
            _raise_for_error(response)
            parts.append(self._decode(response.content, len(chunk)))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def _fetch(self, rows: list[tuple[int, ...]]) -> np.ndarray:
        client = self._async_client()
        parts = []
        for start in range(0, len(rows), self.max_rows_per_request):
            chunk = rows[start : start + self.max_rows_per_request]
            response = await client.post("/v1/next_token_logprobs", content=self._request_body(chunk))
            _raise_for_error(response)
            parts.append(self._decode(response.content, len(chunk)))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:  # an AsyncClient belongs to one loop
            self._async = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout)
            self._async_loop = loop
        return self._async

    async def next_token_logprobs(self, token_ids: Sequence[int]) -> Any:
        """log_softmax over the whole vocabulary after `token_ids`; concurrent calls share one request."""
        return _as_output(np.array(await self._row(tuple(token_ids))))  # a copy: callers may edit it

    async def _row(self, row: tuple[int, ...]) -> np.ndarray:
        cached = self._cache.get(row)
        if cached is not None:
            return cached
        future = self._pending.get(row)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._pending[row] = future
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush())
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        # Let every coroutine that is about to ask for a row (e.g. all particles of one step) ask.
        for _ in range(3):
            await asyncio.sleep(0)
        while self._pending:
            pending, self._pending = self._pending, {}
            rows = list(pending)
            try:
                values = await self._fetch(rows)
            except Exception as exc:
                for future in pending.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            self._remember(rows, values)
            for row, value in zip(rows, values, strict=True):
                if not pending[row].done():
                    pending[row].set_result(value)

    def next_token_logprobs_sync(self, token_ids: Sequence[int]) -> Any:
        return self.batch_next_token_logprobs_sync([token_ids])[0]

    async def batch_next_token_logprobs(self, token_ids_list: Sequence[Sequence[int]]) -> Any:
        rows = await asyncio.gather(*(self._row(tuple(t)) for t in token_ids_list))
        return _as_output(np.stack(rows))

    def batch_next_token_logprobs_sync(self, token_ids_list: Sequence[Sequence[int]]) -> Any:
        rows = [tuple(t) for t in token_ids_list]
        missing = list(dict.fromkeys(r for r in rows if r not in self._cache))
        fetched = dict(zip(missing, self._fetch_sync(missing), strict=True)) if missing else {}
        self._remember(missing, [fetched[r] for r in missing])
        return _as_output(np.stack([fetched[r] if r in fetched else self._cache[r] for r in rows]))

    def clear_cache(self) -> None:
        self._cache.clear()

    # -- sampling (genlm's AsyncLM.sample semantics: stop before an end-of-sequence token) --------

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[int]:
        rng = np.random.default_rng(seed)
        eos = set(eos_token_ids)
        generated: list[int] = []
        for _ in range(max_tokens):
            logprobs = await self._row(tuple(prompt_token_ids) + tuple(generated))
            scaled = logprobs.astype(np.float64) / temperature
            probs = np.exp(scaled - scaled.max())
            token = int(rng.choice(probs.shape[0], p=probs / probs.sum()))
            if token in eos:
                break
            generated.append(token)
        return generated

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[Sequence[int]],
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        eos = list(eos_token_ids)
        return list(
            await asyncio.gather(
                *(self.sample(p, max_tokens, eos, temperature, seed) for p in prompt_token_ids_list)
            )
        )

    # -- lifecycle -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.aclose()
            self._async = None
        self._sync.close()

    def close(self) -> None:
        self._sync.close()

    async def __aenter__(self) -> AsyncGatewayLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> AsyncGatewayLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
