"""The `logprob-gateway` command line: `serve` (checks, then uvicorn), `fleet` (replicas behind a
router: gateway/fleet.py), `hash-key`, `openapi`."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import logging
import sys
from collections.abc import Sequence

from backends.registry import BACKEND_NAMES, DENSE_BACKEND_NAMES
from gateway import fleet
from gateway.openai.tool_formats import TOOL_FORMATS
from gateway.server.preflight import check_before_loading
from gateway.settings import CacheSettings, ConfigError, ModelSettings, Settings, load_settings

DESCRIPTION = (
    "An OpenAI-compatible HTTP gateway in front of in-process language-model engines, with the "
    "whole next-token distribution (/v1/next_token_logprobs) for research on constrained and "
    "probabilistic generation."
)
SERVE_DESCRIPTION = (
    "Serve the configured models over HTTP until SIGTERM or Ctrl-C. Flags override the "
    "LOGPROB_GATEWAY_* environment variables, which override the config file; every setting, its "
    "variable and its default: docs/configuration.md. Exits with 2 when a setting is invalid or a "
    "check before loading fails (the address is taken, a backend's library or a model directory is "
    "missing), with 1 when a model fails to load."
)


def distribution_version() -> str:
    try:
        return importlib.metadata.version("logprob-gateway")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    top, model, cache = Settings(), ModelSettings(), CacheSettings()
    parser = argparse.ArgumentParser(prog="logprob-gateway", description=DESCRIPTION)
    version = f"logprob-gateway {distribution_version()}"
    parser.add_argument("--version", action="version", version=version)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,fleet,hash-key,openapi}")
    serve = commands.add_parser(
        "serve", help="serve the configured models over HTTP", description=SERVE_DESCRIPTION
    )
    serve.add_argument("--version", action="version", version=version)
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config file: docs/configuration.md (env LOGPROB_GATEWAY_CONFIG)",
    )
    serve.add_argument("--host", help=f"address to listen on (default: {top.host})")
    serve.add_argument("--port", type=int, help=f"port to listen on (default: {top.port})")
    serve.add_argument(
        "--model",
        metavar="NAME_OR_DIR",
        help=f"a local Hugging Face directory or a built-in model (default: {model.model})",
    )
    serve.add_argument("--backend", choices=BACKEND_NAMES, help=f"the engine (default: {model.backend})")
    serve.add_argument(
        "--dense-backend",
        choices=DENSE_BACKEND_NAMES,
        help="the engine that computes dense rows and prompt scores while --backend generates; "
        f"self: --backend does both (default: {model.dense_backend})",
    )
    serve.add_argument(
        "--served-model-name", dest="name", help="the name clients use (default: from --model)"
    )
    serve.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help=f"compute dtype; auto is float32 on CPU, bfloat16 on CUDA (default: {model.dtype})",
    )
    serve.add_argument("--device", help=f"auto, cpu, cuda or cuda:N (default: {model.device})")
    serve.add_argument(
        "--max-model-len", type=int, metavar="TOKENS", help="context length (default: the model's own)"
    )
    serve.add_argument(
        "--weights-root",
        metavar="DIR",
        help="/update_weights_from_disk reads only inside it (default: off, no run-time weight loads)",
    )
    serve.add_argument(
        "--chat-template",
        metavar="NAME_OR_FILE",
        help="the chat template: a shipped one's name, tokenizer (the model's own), or a Jinja file "
        "inside --chat-templates-root (default: smollm2-tools for smollm2-135m, else the model's own)",
    )
    serve.add_argument(
        "--chat-templates-root",
        metavar="DIR",
        help="--chat-template files are read only inside it (default: none, shipped templates only)",
    )
    serve.add_argument(
        "--tool-call-format",
        choices=list(TOOL_FORMATS),
        help="the model's tool-call syntax, for tool_choice auto (default: read off the chat template)",
    )
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help=f"how much to log (default: {top.log_level})",
    )
    serve.add_argument(
        "--redis-url",
        metavar="URL",
        help=f"share the output cache through Redis (default: {cache.redis_url or 'an in-process LRU'})",
    )
    serve.add_argument(
        "--no-cache",
        dest="cache_enabled",
        action="store_const",
        const=False,
        help="turn the output cache off",
    )
    serve.add_argument(
        "--no-shared-memory",
        dest="shared_memory",
        action="store_const",
        const=False,
        help="always send dense answers in the body, never into a same-host client's memory",
    )
    serve.add_argument(
        "--no-local-socket",
        dest="local_socket",
        action="store_const",
        const=False,
        help="answer same-host clients over HTTP only, never over a Unix socket",
    )
    serve.add_argument(
        "--trusted-weight-sync",
        dest="trusted_weight_sync",
        action="store_const",
        const=True,
        help="a gateway dedicated to one RL trainer: its weight-sync calls need no admin key",
    )
    serve.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads of the engines' math on the CPU (default: OMP_NUM_THREADS if set, else half "
        "the CPUs this process may use)",
    )
    fleet.add_parser(commands)
    hashed = commands.add_parser(
        "hash-key", help="print the api_keys entry for a key read from standard input (never from argv)"
    )
    hashed.add_argument("--name", help="a name for the key, used by per-key limits")
    spec = commands.add_parser("openapi", help="write the OpenAPI document (default settings) as JSON")
    spec.add_argument("--output", "-o", default="-", help="file to write (default: standard output)")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return load_settings(args.config, overrides)


SERVING_GC_THRESHOLD = 50_000  # allocations between young-generation collections, from 700


def tune_collector() -> None:
    """Python's collector, for a process that serves its models and nothing else; run once they
    have loaded. What loading made lives as long as the process: torch, transformers and the app
    hold hundreds of thousands of objects, which every full pass of the collector walks holding the
    interpreter lock, so the engine's thread stalls with the event loop. Frozen, full passes walk
    only what came later. A request makes thousands of containers (decoded rows, keys, futures)
    that die with it: collected every 700 allocations, the collector walked them while still
    alive, within every large request; with a higher threshold they are freed before it runs."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(SERVING_GC_THRESHOLD, *gc.get_threshold()[1:])


def serve(settings: Settings) -> int:
    """Serve until SIGTERM or Ctrl-C (0); a model that fails to load at start stops the server (1):
    it cannot serve what it was configured for, so it exits for the orchestrator to see; one whose
    configuration is found wrong only once loaded (composed engines that do not match) exits 2."""
    from backends.cpu_threads import use_compute_threads
    from gateway.app import serving_app
    from gateway.server.console import announce_ready, explain_interrupts
    from gateway.server.log_config import uvicorn_log_config
    from gateway.server.shutdown import draining_server

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger(__name__).info(
        "%d threads for the engines' math", use_compute_threads(settings.threads)
    )
    failed: dict[str, str] = {}

    def stop_serving(failures: dict[str, str]) -> None:
        failed.update(failures)
        server.should_exit = True  # the same drain and shutdown as after SIGTERM

    def loaded() -> None:
        tune_collector()
        announce_ready(server, litestar_app.state.registry.models, settings.host, settings.port)

    litestar_app, app = serving_app(settings, on_loaded=loaded, on_load_failed=stop_serving)
    # SIGTERM: /health turns 503 while in-flight requests finish for up to the grace period; then
    # what is left ends cleanly and the app's shutdown runs (engines, cache):
    # gateway/server/shutdown.py.
    # The protocol answers malformed HTTP in the error shape and bounds header reads and stalled writes.
    server = draining_server(
        app,
        settings,
        litestar_app.state.shutdown,
        log_level=settings.log_level,
        log_config=uvicorn_log_config(route.path for route in litestar_app.routes),
    )
    explain_interrupts(server)
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run
        server.run()
    models = litestar_app.state.registry.models
    for name, error in failed.items():
        if models[name].misconfigured:  # the configuration's to change: said as a refused setting is
            print(f"logprob-gateway: model {name!r}: {error.partition(': ')[2]}", file=sys.stderr)
        else:
            print(f"logprob-gateway: model {name!r} failed to load: {error}", file=sys.stderr)
    if any(models[name].misconfigured for name in failed):
        return 2
    return 1 if failed else 0


def write_openapi(output: str) -> None:
    import json

    from gateway.app import ROUTE_HANDLERS
    from gateway.contract.document import build_openapi

    text = json.dumps(build_openapi(ROUTE_HANDLERS), indent=2, sort_keys=True) + "\n"
    if output == "-":
        sys.stdout.write(text)
    else:
        with open(output, "w") as f:
            f.write(text)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "openapi":
        write_openapi(args.output)
        return 0
    if args.command == "fleet":
        return fleet.run(args)
    if args.command == "hash-key":
        from gateway.access import hash_key

        key = sys.stdin.readline().strip()
        if not key:
            print("logprob-gateway: give the key on standard input", file=sys.stderr)
            return 2
        print(hash_key(key, args.name))
        return 0
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"logprob-gateway: {exc}", file=sys.stderr)
        return 2
    problems = check_before_loading(settings)
    for problem in problems:
        print(f"logprob-gateway: {problem}", file=sys.stderr)
    if problems:
        return 2
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
