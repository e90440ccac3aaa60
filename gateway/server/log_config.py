"""Logging of the served process: uvicorn's configuration, with access lines that carry no secrets.

uvicorn's access line is the request line as the client sent it, query string included; a client
that puts its API key there (`?api_key=sk-...`, as some SDKs allow) would have it written to the
log of a shared service, and a path segment (`GET /v1/models/<name>`) is as much the client's
text. No route of the gateway reads a query string, so access lines drop it and say so; a path
is logged as the route it matched, its parameters by name (`/v1/models/{model}`), and a path
that matched no route not at all.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterable
from typing import Any

from uvicorn.config import LOGGING_CONFIG

QUERY_DROPPED = "?[query string not logged]"
UNKNOWN_PATH = "[unknown path not logged]"
_PATH_ARG = 2  # uvicorn's access record: (client address, method, path with query, HTTP version, status)


def _route_pattern(template: str) -> tuple[re.Pattern[str], str]:
    """A route template (`/v1/models/{model:str}`) as a regex over paths, and as logged."""
    parts = template.split("/")
    regex = "/".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
    shown = "/".join("{" + p[1:].split(":")[0].rstrip("}") + "}" if p.startswith("{") else p for p in parts)
    return re.compile(regex), shown


class RedactAccessPaths(logging.Filter):
    """Rewrites uvicorn's access records: no query string, a path as the route it matched."""

    def __init__(self, routes: Iterable[str] = ()) -> None:
        super().__init__()
        routes = list(routes)
        self.exact = {r for r in routes if "{" not in r}
        self.patterns = [_route_pattern(r) for r in routes if "{" in r]

    def loggable(self, path: str) -> str:
        if path in self.exact:
            return path
        return next((shown for regex, shown in self.patterns if regex.fullmatch(path)), UNKNOWN_PATH)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > _PATH_ARG and isinstance(args[_PATH_ARG], str):
            path, query_mark, _ = args[_PATH_ARG].partition("?")
            shown = self.loggable(path) + (QUERY_DROPPED if query_mark else "")
            record.args = (*args[:_PATH_ARG], shown, *args[_PATH_ARG + 1 :])
        return True


def uvicorn_log_config(routes: Iterable[str] = ()) -> dict[str, Any]:
    """uvicorn's own logging configuration, with the filter on its access handler; `routes`: the
    app's path templates, the only paths access lines show."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_access_paths"] = {
        "()": RedactAccessPaths,
        "routes": list(routes),
    }
    config["handlers"]["access"].setdefault("filters", []).append("redact_access_paths")
    return config
