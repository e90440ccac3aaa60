"""What routes read off a request: its body (JSON or MessagePack, by Content-Type), the answer
it prefers (Accept), the app's services, and the reservations a request takes (stream slots,
answer bytes, dense rows of its key's budget)."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from litestar import Request

from gateway.access import Access
from gateway.body_decode import BodyDecoder, decode_body
from gateway.errors import InvalidRequestError, PayloadTooLargeError, UnsupportedMediaTypeError
from gateway.guard import ANSWER_BYTES_KEY, KEY_NAME, STREAM_KEY
from gateway.metrics import set_labels
from gateway.models.registry import ModelRegistry
from gateway.models.served import ServedModel
from gateway.schemas.logprobs import NextTokenLogprobsRequest
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
    if body_type is NextTokenLogprobsRequest:
        body = await request.body()
    else:
        body = await read_non_dense_body(request)
    decoder = body_decoder(request)
    if decoder.inline(body):
        return decode_body(body, binary, body_type)
    dense = body_type is NextTokenLogprobsRequest
    return await decoder.decode(
        body,
        binary,
        body_type,
        client=request.scope.get(KEY_NAME),  # the decode workers are shared fairly between keys
        max_rows=settings(request).limits.max_rows if dense else 0,
    )


async def read_non_dense_body(request: Request) -> bytes:
    """The body of another route than the dense one, within `max_non_dense_body_bytes`: a 413 by
    its Content-Length before it is read, or once that many bytes are in (a chunked body declares
    no length), the rest unread. Such a body, once valid, is decoded on the event loop, so its
    size bounds how long the loop is held."""
    limit = settings(request).limits.max_non_dense_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"the request body is {size}; this route takes at most {limit} "
        "(max_non_dense_body_bytes; only /v1/next_token_logprobs takes up to max_body_bytes)"
    )


def body_decoder(request: Request) -> BodyDecoder:
    """The app's decoder of request bodies, made on first use with its settings' threshold (again
    on another event loop, as an app served in-process by successive test clients is)."""
    state = request.app.state
    decoder = getattr(state, "body_decoder", None)
    if decoder is None or decoder.loop not in (None, asyncio.get_running_loop()):
        if decoder is not None:
            decoder.kill_workers()  # their pipes belong to the loop they were started on
        limits = settings(request).limits
        decoder = state.body_decoder = BodyDecoder(
            limits.decode_worker_bytes, limits.decode_workers, limits.decode_queue
        )
    return decoder


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


def with_lora_path(
    request: Request, named: tuple[ServedModel, str | None], model: str, lora_path: str | None
) -> tuple[ServedModel, str | None]:
    """The model and adapter a request names in `model` (resolved: `named`), under SGLang's
    `lora_path` field if it gives one: a router that knows only base model names forwards the
    field unchanged. A `lora_path` naming another adapter than `model` does is a 400."""
    served, adapter = named
    if lora_path is None or lora_path == adapter:
        return named
    if adapter is not None:
        raise InvalidRequestError(
            f"lora_path {lora_path!r} contradicts the adapter in model {model!r}", param="lora_path"
        )
    return resolve_model(request, f"{served.name}:{lora_path}")


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


class Admission:
    """gateway.dense.service.Admission of an HTTP request: its key's budgets (gateway.guard gives
    the answer's bytes back once the response is sent or abandoned)."""

    def __init__(self, request: Request) -> None:
        self.request = request

    def take_rows(self, rows: int) -> None:
        charge_rows(self.request, rows)

    def reserve_answer_bytes(self, nbytes: int) -> None:
        reserve_answer_bytes(self.request, nbytes)
