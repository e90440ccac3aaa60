"""`logprob-gateway serve`: run the gateway with uvicorn."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence

from backends.base import BACKEND_NAMES
from gateway.settings import ConfigError, Settings, load_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logprob-gateway", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the configured models over HTTP")
    serve.add_argument("--config", help="TOML config file (see gateway/settings.py)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--model", help="local Hugging Face directory or built-in model (default: smollm2-135m)"
    )
    serve.add_argument("--backend", choices=BACKEND_NAMES)
    serve.add_argument(
        "--served-model-name", dest="name", help="the name clients use (default: from --model)"
    )
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--weights-root", help="/update_weights_from_disk reads only inside it (default: off)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--redis-url", help="share the output cache through Redis (default: in-process LRU)")
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
        "--trusted-weight-sync",
        dest="trusted_weight_sync",
        action="store_const",
        const=True,
        help="a gateway dedicated to one RL trainer: its weight-sync calls need no admin key",
    )
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


def serve(settings: Settings) -> None:
    import uvicorn

    from gateway.app import serving_app
    from gateway.server_logging import uvicorn_log_config

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _, app = serving_app(settings, on_loaded=tune_collector)
    # SIGTERM: uvicorn stops accepting connections, lets in-flight requests finish for up to the
    # grace period, then cancels what is left and runs the app's shutdown (engines, cache).
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=uvicorn_log_config(),
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        http="gateway.server_protocol:GatewayHTTPProtocol",  # malformed HTTP answered in the error shape
    )


def write_openapi(output: str) -> None:
    import json

    from gateway.openapi import build_openapi

    text = json.dumps(build_openapi(), indent=2, sort_keys=True) + "\n"
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
    serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
