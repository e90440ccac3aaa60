"""Dense next-token log-probabilities, two ways: the Python client `AsyncGatewayLM`, and plain
httpx with base64 rows decoded by numpy. Both give the same numbers.

Serve:  logprob-gateway serve
Run:    python examples/dense_rows.py   (LOGPROB_GATEWAY_URL, default http://127.0.0.1:8000)
"""

import asyncio
import base64
import os

import httpx
import numpy as np

from logprob_gateway_client import AsyncGatewayLM

BASE_URL = os.environ.get("LOGPROB_GATEWAY_URL", "http://127.0.0.1:8000")
MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "Once upon a time"]


async def main() -> None:
    # Token ids from the gateway's own tokenizer, so this script needs no transformers.
    ids = [
        httpx.post(f"{BASE_URL}/v1/tokenize", json={"model": MODEL, "prompt": p}, timeout=60).json()["tokens"]
        for p in PROMPTS
    ]

    async with AsyncGatewayLM(BASE_URL, MODEL) as llm:
        # Concurrent calls (an SMC step's particles) travel to the gateway in one request.
        rows = await asyncio.gather(*(llm.next_token_logprobs(row) for row in ids))
        from_client = np.stack([np.asarray(row) for row in rows])  # torch tensors when torch is installed
        vocabulary = llm.byte_vocab

    # The same rows over plain HTTP: each row's float32 bytes (little-endian) in base64.
    answer = httpx.post(
        f"{BASE_URL}/v1/next_token_logprobs",
        json={"model": MODEL, "input": ids, "encoding_format": "base64"},
        timeout=60,
    ).json()
    from_http = np.stack([np.frombuffer(base64.b64decode(d["logprobs"]), "<f4") for d in answer["data"]])

    print(f"rows: {from_client.shape[0]} x {from_client.shape[1]} (vocab_size {answer['vocab_size']})")
    for prompt, row in zip(PROMPTS, from_http, strict=True):
        top = np.argsort(row)[::-1][:3]
        print(
            f"{prompt!r} -> "
            + ", ".join(f"{vocabulary[t].decode(errors='replace')!r} {row[t]:.3f}" for t in top)
        )
    difference = float(np.max(np.abs(from_client - from_http)))
    print(f"max abs difference: {difference:.3g}")
    print(f"agree: {difference <= 1e-5}")


asyncio.run(main())
