"""Function calling with the official `openai` SDK: the model calls `get_weather`, this script
runs it and sends the result back as a `tool` message, and the model answers in text.

Serve:  logprob-gateway serve
Run:    python examples/tools.py   (LOGPROB_GATEWAY_URL, default http://127.0.0.1:8000)
"""

import json
import os

from openai import OpenAI

BASE_URL = os.environ.get("LOGPROB_GATEWAY_URL", "http://127.0.0.1:8000")
MODEL = "smollm2-135m"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current temperature in a city.",
        "parameters": {
            "type": "object",
            # maxLength: a small model could otherwise write one long string until max_tokens
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


def get_weather(city: str, unit: str) -> dict:
    """A stand-in for a weather service."""
    celsius = 21
    return {
        "city": city,
        "temperature": celsius if unit == "celsius" else round(celsius * 1.8 + 32),
        "unit": unit,
    }


client = OpenAI(base_url=BASE_URL + "/v1", api_key="unused")
messages = [
    {"role": "system", "content": "Answer the user in one sentence using the tool's result."},
    {"role": "user", "content": "What is the weather in Paris?"},
]

# Naming the function forces one call of it; the gateway holds its arguments to the schema, so
# they always parse and validate ("required" would let the model pick among several tools).
asked = client.chat.completions.create(
    model=MODEL,
    messages=messages,
    tools=[WEATHER_TOOL],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    max_tokens=60,
    temperature=0,
)
(call,) = asked.choices[0].message.tool_calls
arguments = json.loads(call.function.arguments)
print(f"call: {call.function.name} {json.dumps(arguments)}")

result = get_weather(**arguments)
print(f"result: {json.dumps(result)}")

# The conversation goes on with the call and its result, and no tools: the answer is text.
messages += [
    {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
]
final = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
print(f"answer: {final.choices[0].message.content}")
