"""Every error the gateway reports, and the single place that turns exceptions into responses.

    GatewayError                       500 internal_error
     ├── InvalidRequestError           400 invalid_request_error   (bad field, bad token id, ...)
     │    └── ContextLengthError       400 invalid_request_error   code=context_length_exceeded
     ├── AuthenticationError           401 authentication_error    (missing or wrong key)
     ├── ForbiddenError                403 permission_error        (disabled, or outside allowed paths)
     ├── ModelNotFoundError            404 invalid_request_error   code=model_not_found
     ├── UnsupportedMediaTypeError     415 invalid_request_error   (a body neither JSON nor MessagePack)
     ├── RequestTimeoutError           408 invalid_request_error   code=request_timeout (a local frame too slow)
     ├── RateLimitError                429 rate_limit_error        (a per-key or server limit; Retry-After)
     ├── ModelNotReadyError            503 service_unavailable     (still loading, or failed; or unusable)
     ├── ShuttingDownError             503 service_unavailable     code=server_shutting_down (after SIGTERM)
     └── EngineError                   500 internal_error          (the engine failed a request)

Responses use OpenAI's error object: {"error": {"message", "type", "param", "code"}}.
Exceptions from request decoding (msgspec) and from Litestar itself (unknown route, wrong
method, body too large) are mapped here too, so no route formats an error by hand.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from backends.errors import AdapterError, EngineUnavailableError, GrammarError, RequestRejectedError
from gateway.schemas.common import NOT_SUPPORTED

log = logging.getLogger(__name__)


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorDetail


class GatewayError(Exception):
    status_code = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def error_object(self) -> dict[str, str | None]:
        """OpenAI's error object of this error, for answers that carry it beside fields of their
        own (SGLang's {success, message} of a weights update)."""
        return {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}


class InvalidRequestError(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


def too_many_inputs(limit: int, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"at most {limit} inputs per request in {param}", param=param)


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class AuthenticationError(GatewayError):
    status_code = 401
    error_type = "authentication_error"


class ForbiddenError(GatewayError):
    status_code = 403
    error_type = "permission_error"


class ModelNotFoundError(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class UnsupportedMediaTypeError(GatewayError):
    status_code = 415
    error_type = "invalid_request_error"
    code = "unsupported_media_type"


class PayloadTooLargeError(GatewayError):
    status_code = 413
    error_type = "invalid_request_error"


class RequestTimeoutError(GatewayError):
    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class RateLimitError(GatewayError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ModelNotReadyError(GatewayError):
    status_code = 503
    error_type = "service_unavailable"
    code = "model_not_ready"


class ShuttingDownError(GatewayError):
    status_code = 503
    error_type = "service_unavailable"
    code = "server_shutting_down"
    retry_after = 1.0  # the client may go to another replica at once


class NotSupportedError(GatewayError):
    """What this engine cannot do (and a restart or another backend can)."""

    status_code = 501
    error_type = "not_implemented"
    code = "not_supported"


class EngineError(GatewayError):
    status_code = 500
    error_type = "internal_error"
    code = "engine_error"


_HTTP_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_PATH = re.compile(r"at `\$\.?([^`]*)`")


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> bytes:
    return msgspec.json.encode(
        ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=code))
    )


def retry_after_headers(exc: GatewayError) -> dict[str, str]:
    seconds = getattr(exc, "retry_after", None)
    return {} if seconds is None else {"Retry-After": str(max(1, math.ceil(seconds)))}


def error_response(
    status: int,
    message: str,
    error_type: str,
    param: str | None,
    code: str | None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        content=error_body(message, error_type, param, code),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def decode_error(exc: msgspec.DecodeError) -> InvalidRequestError:
    """A request body that is not valid JSON or does not match the schema."""
    message = str(exc)
    match = _PATH.search(message)
    # msgspec spells a dict value's key as "[...]" (`logit_bias[...]`): name the field itself instead
    param = match.group(1).split("[...]")[0] if match and match.group(1) else None
    if isinstance(exc, msgspec.ValidationError):
        field = (param or "").split(".")[0].split("[")[0]
        hint = f" ({field}: {NOT_SUPPORTED[field]})" if field in NOT_SUPPORTED else ""
        return InvalidRequestError(f"invalid request: {message}{hint}", param=param)
    return InvalidRequestError(f"request body is not valid JSON: {message}", param=param)


def _handle_gateway_error(_: Request, exc: GatewayError) -> Response:
    if exc.status_code >= 500:
        log.error("%s: %s", type(exc).__name__, exc.message)
    return error_response(
        exc.status_code, exc.message, exc.error_type, exc.param, exc.code, retry_after_headers(exc)
    )


def _handle_decode_error(request: Request, exc: msgspec.DecodeError) -> Response:
    return _handle_gateway_error(request, decode_error(exc))


def _handle_http_exception(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    error_type = _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    # Litestar says what it needs to in headers too: a 405's Allow, for one
    return error_response(status, exc.detail, error_type, None, None, exc.headers)


def _handle_adapter_error(request: Request, exc: AdapterError) -> Response:
    """An adapter unloaded while a request for it was in flight, or one the engine rejects."""
    return _handle_gateway_error(request, InvalidRequestError(str(exc), param="model"))


def _handle_rejected(request: Request, exc: RequestRejectedError) -> Response:
    return _handle_gateway_error(request, InvalidRequestError(str(exc), param=exc.param))


def _handle_grammar(request: Request, exc: GrammarError) -> Response:
    """A grammar that fails while generating (a step beyond the grammar engine's limits)."""
    return _handle_gateway_error(request, InvalidRequestError(str(exc)))


def _handle_unavailable(request: Request, exc: EngineUnavailableError) -> Response:
    """A model whose engine cannot serve until it is given weights again (backends/composed/)."""
    return _handle_gateway_error(request, ModelNotReadyError(str(exc)))


def _handle_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unexpected error", exc_info=exc)
    return error_response(500, "internal server error", "internal_error", None, None)


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    GatewayError: _handle_gateway_error,
    msgspec.DecodeError: _handle_decode_error,
    AdapterError: _handle_adapter_error,
    RequestRejectedError: _handle_rejected,
    GrammarError: _handle_grammar,
    EngineUnavailableError: _handle_unavailable,
    HTTPException: _handle_http_exception,
    Exception: _handle_unexpected,
}
