"""Logging of the served process: uvicorn's configuration, with access lines that carry no secrets.

uvicorn's access line is the request line as the client sent it, query string included; a client
that puts its API key there (`?api_key=sk-...`, as some SDKs allow) would have it written to the
log of a shared service. No route of the gateway reads a query string, so access lines keep the
path alone and say that a query string was dropped.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from uvicorn.config import LOGGING_CONFIG

QUERY_DROPPED = "?[query string not logged]"
_PATH_ARG = 2  # uvicorn's access record: (client address, method, path with query, HTTP version, status)


class DropQueryStrings(logging.Filter):
    """Rewrites uvicorn's access records so their path has no query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > _PATH_ARG and isinstance(args[_PATH_ARG], str):
            path, query_mark, _ = args[_PATH_ARG].partition("?")
            if query_mark:
                record.args = (*args[:_PATH_ARG], path + QUERY_DROPPED, *args[_PATH_ARG + 1 :])
        return True


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging configuration, with the filter on its access handler."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["drop_query_strings"] = {"()": DropQueryStrings}
    config["handlers"]["access"].setdefault("filters", []).append("drop_query_strings")
    return config
