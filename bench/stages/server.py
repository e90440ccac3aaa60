"""The gateway's command line with its dense calls over the local socket stamped at each stage:
`python -m bench.stages.server serve ...`, as bench/server_stages.py starts it. The stamps go to
$STAGE_OUT followed by the process's PID when it ends.

The stages, in a call's order: the frame read, the request's task running, the body decoded, the
model resolved, token checks, the answer's bytes reserved, the service, the client's segment
found, the cache's keys and lookup, the engine calls, the engine call, the rows landing in the
client's memory, and the answer back through each layer to the socket's write. Each wrapped
function is named by reference (bench/stages/stamps.py): one renamed in the gateway stops this
command at its start."""

from __future__ import annotations

import atexit
import os
import signal
import sys

import gateway.access
import gateway.cli
import gateway.dense.engine_calls
import gateway.dense.local_socket
import gateway.dense.row_cache
import gateway.dense.service
import gateway.dense.shared_memory
import gateway.models.registry
import gateway.requests
from backends.mock import MockEngine, MockHostMemory
from bench.stages.stamps import dump, stamp

FIRST = "frame in"


def install() -> None:
    ls, service = gateway.dense.local_socket, gateway.dense.service
    stamp(ls._Connection, ls._Connection.data_received, FIRST)
    stamp(ls.LocalSocketServer, ls.LocalSocketServer.answer, "task runs", "answered")
    stamp(gateway.requests, gateway.requests.decode_body, "decode", "decoded")
    registry = gateway.models.registry.ModelRegistry
    stamp(registry, registry.resolve, "resolve", "resolved")
    stamp(service, service.dense_inputs, "token checks", "checked")  # imported into service: wrapped there
    stamp(gateway.access.Access, gateway.access.Access.reserve_answer_bytes, "reserve", "reserved")
    stamp(service.DenseService, service.DenseService.answer, "service", "service done")
    writer = gateway.dense.shared_memory.SharedMemoryWriter
    stamp(writer, writer.target, "segment", "segment found")
    stamp(
        service.DenseService,
        service.DenseService.logprobs,
        "rows: keys, lookup",
        "rows done",
        rows=lambda args: len(args[3]),  # (self, served, adapter, rows, ...)
    )
    cache = gateway.dense.row_cache.RowCache
    stamp(cache, cache.lookup, "lookup", "looked up")
    calls = gateway.dense.engine_calls.EngineCalls
    stamp(calls, calls.logprobs, "engine calls", "engine calls done")
    engines, host_memories = [MockEngine], [MockHostMemory]
    try:
        from backends.transformers.capabilities import TransformersHostMemory
        from backends.transformers.engine import TransformersEngine
        from backends.transformers.host_copy import CudaHostMemory
    except ImportError:  # no torch: the mock alone
        pass
    else:
        engines.append(TransformersEngine)
        host_memories.append(CudaHostMemory)
        # rows written from the device: the engine's call for them (the mock's writes call its
        # next_token_logprobs, stamped above)
        stamp(TransformersHostMemory, TransformersHostMemory.write_rows, "engine", "engine done")
    for engine in engines:
        stamp(engine, engine.next_token_logprobs, "engine", "engine done")
    for host_memory in host_memories:  # the client's rows landing, after the engine call
        stamp(host_memory, host_memory.wait_landed, "landing", "landed")
    stamp(ls._Connection, ls._Connection._send, "send", "sent")


def main() -> int:
    if "STAGE_OUT" not in os.environ:
        sys.exit("set STAGE_OUT to where the stamps go (bench/server_stages.py does)")
    install()
    path = f"{os.environ['STAGE_OUT']}{os.getpid()}"
    atexit.register(dump, FIRST, path)

    def on_term(*_: object) -> None:  # a stop before the server's own handlers are in place
        dump(FIRST, path)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    return gateway.cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
