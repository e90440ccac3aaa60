"""SGLang's native `/generate`, as a round's client: the form SGLang's own benchmarks send.

The gateway serves the same endpoint (docs/sglang-clients.md), so one body measures both servers.
A request is a plain JSON post through the openai SDK client's own HTTP transport, without the
SDK's request and response models. (httpx's own connection pool rescans every connection at
each request's turn: at 64 requests at once from one process it cost four times the CPU a
request.)
"""

from __future__ import annotations

import time
from typing import Any

import openai

from bench.generation_targets import Completion, OpenAICompletions, OutputGrammar, RequestPerPrompt


class NativeGenerate(RequestPerPrompt):
    """Greedy completions through `POST /generate` at `base_url`; no grammars (the gateway's
    `/generate` takes none)."""

    takes_grammars = False

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)

    async def one(
        self, prompt: str, max_tokens: int, grammar: OutputGrammar | None, logprobs: int | None
    ) -> Completion:
        if grammar is not None:
            raise ValueError("/generate is driven without grammars")
        body: dict = {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
        if logprobs is not None:
            body["return_logprob"] = True
        started = time.perf_counter()
        answer: Any = await self.client.post("/generate", body=body, cast_to=object)
        latency = time.perf_counter() - started
        meta = answer["meta_info"]
        chosen = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        return Completion(answer["text"], chosen, int(meta["completion_tokens"]), latency)

    async def close(self) -> None:
        await self.client.close()


GENERATE_SERVERS = ("gateway", "sglang")  # the servers that serve /generate


def http_client(api: str, base_url: str, server: str) -> OpenAICompletions | NativeGenerate:
    """The client of `api` (`completions`: the openai SDK's /v1/completions; `generate`: SGLang's
    /generate) for `server` ("gateway", "sglang" or "vllm") at `base_url`."""
    if api == "completions":
        return OpenAICompletions(base_url, server)
    if server not in GENERATE_SERVERS:
        raise ValueError(f"{server} serves no SGLang /generate")
    return NativeGenerate(base_url)
