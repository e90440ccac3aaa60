"""What routes read off a request: its body (JSON or MessagePack, by Content-Type), the answer
it prefers (Accept), the app's services, and the reservations a request takes (stream slots,
answer bytes, dense rows of its key's budget)."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from litestar import Request

from gateway.access import Access
from gateway.errors import InvalidRequestError, UnsupportedMediaTypeError
from gateway.guard import ANSWER_BYTES_KEY, KEY_NAME, STREAM_KEY
from gateway.metrics import set_labels
from gateway.registry import ModelRegistry, ServedModel
from gateway.settings import Settings

T = TypeVar("T")

MSGPACK_TYPES = ("application/msgpack", "application/vnd.msgpack", "application/x-msgpack")


def is_msgpack(media_type: str | None) -> bool:
    return bool(media_type) and any(t in media_type for t in MSGPACK_TYPES)  # type: ignore[operator]


def is_json(media_type: str) -> bool:
    """application/json or a `+json` type, parameters (charset) aside."""
    essence = media_type.split(";", 1)[0].strip().lower()
    return essence == "application/json" or essence.endswith("+json")


async def decode_json(request: Request, body_type: type[T]) -> T:
    """Decode and validate a JSON body (or MessagePack, by Content-Type; none: JSON); errors
    become 400s in errors.py, another Content-Type (a form, text) a 415 before the body is read."""
    media_type = request.headers.get("content-type")
    binary = is_msgpack(media_type)
    if media_type and not binary and not is_json(media_type):
        raise UnsupportedMediaTypeError(
            f"Content-Type {media_type[:100]!r} is not supported: send the body as application/json "
            f"(or {MSGPACK_TYPES[0]})"
        )
    return decode_body(await request.body(), binary, body_type)


def decode_body(body: bytes, binary: bool, body_type: type[T]) -> T:
    """A request body (MessagePack when `binary`, else JSON) as `body_type`; errors become 400s."""
    try:
        try:
            if binary:
                return msgspec.msgpack.decode(body, type=body_type)
            return msgspec.json.decode(body, type=body_type)
        except msgspec.ValidationError as exc:
            if len(body) > INTEGRAL_FLOAT_RETRY_BYTES or _GOT_FLOAT not in str(exc):
                raise
            return _decode_with_integral_floats(body, binary, body_type, exc)
    except UnicodeDecodeError as exc:
        # msgspec raises this (not a DecodeError) for a string that is not UTF-8, in either format
        raise InvalidRequestError(f"request body has a string that is not valid UTF-8: {exc}") from None
    except RecursionError:
        # msgspec recurses once per level of nesting, in fields the type ignores too
        raise InvalidRequestError("request body is nested too deeply") from None


_INT64 = range(-(2**63), 2**63)
# The integral-float retry decodes the body again untyped, which costs several times the typed
# decode in time and memory: only for the error it can fix, and only for bodies small enough that
# the retry stays short on the event loop (a larger body keeps the typed decode's error).
INTEGRAL_FLOAT_RETRY_BYTES = 1 << 20
_GOT_FLOAT = ", got `float`"  # where an integer (or a union with one) belongs


def _integral_floats_to_ints(document: Any) -> bool:
    """Turn, in place, every finite float with no fractional part (within int64) into an int; True
    when there was one. Walks with a stack: documents nest as deep as the body does."""
    changed = False
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        for key, value in list(items):
            if isinstance(value, float) and value.is_integer() and int(value) in _INT64:
                node[key] = int(value)
                changed = True
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return changed


def _decode_with_integral_floats(
    body: bytes, binary: bool, body_type: type[T], error: msgspec.ValidationError
) -> T:
    """JSON Schema, and so the OpenAPI document, counts 1.0 as an integer: a body the typed decode
    refused is decoded again with such floats as ints. With none, the typed decode's error stands."""
    try:
        document = msgspec.msgpack.decode(body) if binary else msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        raise error from None
    if not _integral_floats_to_ints(document):
        raise error
    # An error now names a field that is wrong as read, not a 1.0 that the retry accepts.
    return msgspec.convert(document, type=body_type, strict=True)


def wants_msgpack(request: Request) -> bool:
    """MessagePack when the Accept header prefers it to JSON (q-values honoured; ties go to JSON)."""
    best = {"msgpack": -1.0, "json": -1.0}
    for part in request.headers.get("accept", "").split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = next((p[2:] for p in params if p.startswith("q=")), "1")
        try:
            weight = float(q)
        except ValueError:
            continue
        kind = (
            "msgpack"
            if is_msgpack(media)
            else "json"
            if media in ("application/json", "*/*", "application/*")
            else ""
        )
        if kind:
            best[kind] = max(best[kind], weight)
    return best["msgpack"] > 0 and best["msgpack"] > best["json"]


def registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def resolve_model(request: Request, name: str) -> tuple[ServedModel, str | None]:
    """The served model and adapter a request names; labels the request's metrics with them."""
    served, adapter = registry(request).resolve(name)
    set_labels(request.scope, served.name, adapter)
    return served, adapter


def settings(request: Request) -> Settings:
    return request.app.state.settings


def access(request: Request) -> Access:
    return request.app.state.access


def reserve_stream(request: Request) -> None:
    """Take one of the server's stream slots (429 when none is free); gateway.guard gives it back
    when the response ends, however it ends. Without the guard (an app used bare) there is no limit."""
    if KEY_NAME in request.scope:
        access(request).reserve_stream()
        request.scope[STREAM_KEY] = True  # type: ignore[literal-required]


def reserve_answer_bytes(request: Request, nbytes: int) -> None:
    """Reserve the answer's bytes in the server-wide budget (gateway.access); gateway.guard gives
    them back once the response is sent to the client or abandoned. Without the guard: no limit."""
    if KEY_NAME in request.scope:
        access(request).reserve_answer_bytes(nbytes)
        request.scope[ANSWER_BYTES_KEY] = nbytes  # type: ignore[literal-required]


def charge_rows(request: Request, rows: int) -> None:
    """Count dense rows against the API key's per-minute budget (429 when spent)."""
    access(request).take_rows(request.scope.get(KEY_NAME), rows)  # type: ignore[arg-type]
