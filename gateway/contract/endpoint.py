"""The operations of the OpenAPI document, read from route handlers: one per path and method of
each handler, with what its decorator says (summary, description, tags, the Operation in `opt`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from inspect import cleandoc

from litestar.handlers import HTTPRouteHandler

from gateway.contract.operation import OPENAPI, Operation

_TYPED_PARAMETER = re.compile(r"\{(\w+):\w+\}")  # Litestar's "{model:str}", OpenAPI's "{model}"


@dataclass(frozen=True)
class Endpoint:
    method: str  # lower case, as OpenAPI keys them
    path: str  # an OpenAPI path template
    handler: HTTPRouteHandler

    @property
    def operation(self) -> Operation:
        return self.handler.opt[OPENAPI]

    @property
    def operation_id(self) -> str:
        return (self.method + self.path).replace("/", "_").replace("{", "").replace("}", "").strip("_")

    @property
    def summary(self) -> str | None:
        return self.handler.summary

    @property
    def description(self) -> str | None:
        """The decorator's, else the handler's docstring (as Litestar's own OpenAPI reads them)."""
        if self.handler.description is not None:
            return self.handler.description
        return cleandoc(self.handler.fn.__doc__) if self.handler.fn.__doc__ else None

    @property
    def tags(self) -> list[str]:
        return list(self.handler.tags or [])

    @property
    def ok_status(self) -> str:
        return str(self.handler.status_code)


def endpoints(handlers: Iterable[HTTPRouteHandler]) -> list[Endpoint]:
    """One endpoint per path and method of each handler; every handler must declare its Operation."""
    found = []
    for handler in handlers:
        if not isinstance(handler.opt.get(OPENAPI), Operation):
            raise TypeError(
                f"route handler {handler.handler_name} declares no opt={{OPENAPI: Operation(...)}}"
            )
        for path in sorted(handler.paths):
            for method in sorted(handler.http_methods):
                found.append(Endpoint(method.lower(), _TYPED_PARAMETER.sub(r"{\1}", path), handler))
    return found
