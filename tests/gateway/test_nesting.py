"""Bodies nested deeper than the decoder recurses, in JSON and MessagePack, on every POST route:
a 400 in OpenAI's error shape (never a 500), and the server keeps serving."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from tests.conftest import MODEL, start_admin_gateway

pytestmark = pytest.mark.slow

ADMIN_KEY = "nesting-admin"
# Each route with a body that is valid but for the nested extra field.
ROUTES = {
    "/v1/completions": {"model": MODEL, "prompt": "a", "max_tokens": 1},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1},
    "/v1/next_token_logprobs": {"model": MODEL, "input": [[1, 2]]},
    "/v1/tokenize": {"model": MODEL, "prompt": "a"},
    "/tokenize": {"model": MODEL, "prompt": "a"},
    "/v1/detokenize": {"model": MODEL, "tokens": [1]},
    "/detokenize": {"model": MODEL, "tokens": [1]},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "a"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}
DEPTHS = [1_000, 100_000]


def json_body(fields: dict, depth: int, key: str = "x") -> bytes:
    """`fields` plus `key`: an array nested `depth` deep."""
    nested = b"[" * depth + b"]" * depth
    return msgspec.json.encode(fields)[:-1] + b',"' + key.encode() + b'":' + nested + b"}"


def msgpack_body(fields: dict, depth: int, key: str = "x") -> bytes:
    """The same in MessagePack, written by hand (an encoder would recurse as deep itself)."""
    entries = [msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in fields.items()]
    nested = b"\x91" * depth + b"\xc0"  # arrays of one element, around a nil
    entries.append(msgspec.msgpack.encode(key) + nested)
    return bytes([0x80 | len(entries)]) + b"".join(entries)


def post(gateway, path: str, body: bytes, content_type: str) -> httpx.Response:
    headers = {"Content-Type": content_type, "Authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.post(gateway.base_url + path, content=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def admin_gateway(model_dir, tmp_path_factory):
    """The real model with an admin key, so that the admin routes decode their bodies too."""
    workdir = tmp_path_factory.mktemp("nesting")
    gateway = start_admin_gateway(model_dir, workdir, workdir, admin_key=ADMIN_KEY)
    yield gateway
    gateway.stop()


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("path", list(ROUTES))
def test_deep_nesting_in_an_ignored_field_is_a_400(admin_gateway, path, encoding, depth):
    if encoding == "json":
        response = post(admin_gateway, path, json_body(ROUTES[path], depth), "application/json")
    else:
        response = post(admin_gateway, path, msgpack_body(ROUTES[path], depth), "application/msgpack")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "nested too deeply" in error["message"]


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_deep_nesting_in_a_typed_field_is_a_400_and_the_server_keeps_serving(admin_gateway, encoding):
    fields = {"model": MODEL, "max_tokens": 1}
    if encoding == "json":
        body, content_type = json_body(fields, 5_000, key="prompt"), "application/json"
    else:
        body, content_type = msgpack_body(fields, 5_000, key="prompt"), "application/msgpack"
    response = post(admin_gateway, "/v1/completions", body, content_type)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    served = post(
        admin_gateway, "/v1/completions", msgspec.json.encode(ROUTES["/v1/completions"]), "application/json"
    )
    assert served.status_code == 200 and served.json()["choices"][0]["text"]
