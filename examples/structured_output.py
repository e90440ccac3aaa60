"""Structured output with the official `openai` SDK: the answer is held to a Pydantic model's JSON
schema by the gateway's grammar, and the SDK parses it back into that model.

Serve:  logprob-gateway serve
Run:    python examples/structured_output.py   (LOGPROB_GATEWAY_URL, default http://127.0.0.1:8000)
"""

import os
from typing import Literal

from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

BASE_URL = os.environ.get("LOGPROB_GATEWAY_URL", "http://127.0.0.1:8000")
MODEL = "smollm2-135m"


class City(BaseModel):
    # No other keys: the schema says so ("additionalProperties": false), and the grammar with it.
    model_config = ConfigDict(extra="forbid")
    # Bounded strings: the grammar then has an end a small model reaches within max_tokens.
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]


client = OpenAI(base_url=BASE_URL + "/v1", api_key="unused")
messages = [{"role": "user", "content": "Describe the city of Paris as JSON."}]

# `parse` sends response_format {"type": "json_schema", ...} built from City and validates the
# answer into it; older SDKs have it as client.beta.chat.completions.parse.
parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
answer = parse(model=MODEL, messages=messages, response_format=City, max_tokens=60, temperature=0)
city = answer.choices[0].message.parsed
print(f"json: {answer.choices[0].message.content}")
print(f"parsed: {city!r}")

# The same without the helper: the schema by hand, the text validated by Pydantic itself.
raw = client.chat.completions.create(
    model=MODEL,
    messages=messages,
    response_format={
        "type": "json_schema",
        "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True},
    },
    max_tokens=60,
    temperature=0,
)
print(f"validated: {City.model_validate_json(raw.choices[0].message.content)!r}")
