"""What `logprob-gateway serve` checks before it loads anything: the address it listens on, each
model's backend library, weights directory and chat template. The common mistakes then fail in milliseconds,
not after minutes of loading (or never, with a server answering 503)."""

from __future__ import annotations

import socket

from backends.builtin_models import check_model_source
from backends.errors import EngineUnavailableError
from backends.registry import SELF, check_backend_installed
from gateway.models.chat_template import chat_template_text
from gateway.settings import ConfigError, Settings


def check_listen_address(host: str, port: int) -> str | None:
    """Bind `host:port` as uvicorn will (every address the host resolves to, SO_REUSEADDR), then
    let it go; None when it can, else why not in one line."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror}"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def check_before_loading(settings: Settings) -> list[str]:
    """Every problem that would stop the server from serving what it is configured for and that
    can be found without loading a model, one line each; empty when there is none."""
    problems = []
    listen = check_listen_address(settings.host, settings.port)
    if listen is not None:
        problems.append(listen)
    for model in settings.models:
        checks = [(check_backend_installed, model.backend), (check_model_source, model.model)]
        if model.dense_backend != SELF:
            checks.append((check_backend_installed, model.dense_backend))
        for check, subject in checks:
            try:
                check(subject)
            except EngineUnavailableError as exc:
                problems.append(f"model {model.served_name!r}: {exc}")
        try:
            chat_template_text(model)
        except ConfigError as exc:
            problems.append(f"model {model.served_name!r}: {exc}")
    return problems
