"""Loaded by every Python process whose path holds this folder (bench/server_stages.py puts it
there for a bench and the gateways it starts): in a process that serves dense calls over the local
socket, it stamps the time at each stage of every call, and writes the stamps to
$STAGE_OUT<pid> when the process ends. A measuring harness: it wraps the gateway's functions, and
is never imported by the gateway itself."""

import atexit
import functools
import os
import signal
import time

if os.environ.get("STAGE_OUT"):
    import backends.mock
    import gateway.access
    import gateway.dense.batcher
    import gateway.dense.local_socket
    import gateway.dense.row_cache
    import gateway.dense.service
    import gateway.dense.shared_memory
    import gateway.registry
    import gateway.requests

    STAMPS: list[tuple[str, float, float]] = []  # (stage, wall clock, the loop thread's CPU time)
    wall, cpu = time.perf_counter, time.thread_time

    def clock():
        return wall(), cpu()

    def _wrap(owner, name, before, after=None):
        function = getattr(owner, name)

        @functools.wraps(function)
        def stamped(*args, **kwargs):
            STAMPS.append((before, *clock()))
            result = function(*args, **kwargs)
            if after:
                STAMPS.append((after, *clock()))
            return result

        setattr(owner, name, stamped)

    def _wrap_async(owner, name, before, after):
        function = getattr(owner, name)

        @functools.wraps(function)
        async def stamped(*args, **kwargs):
            STAMPS.append((before, *clock()))
            result = await function(*args, **kwargs)
            STAMPS.append((after, *clock()))
            return result

        setattr(owner, name, stamped)

    def _rows(function):
        @functools.wraps(function)
        async def stamped(self, served, adapter, rows, *args, **kwargs):
            STAMPS.append((f"rows={len(rows)}", 0.0, 0.0))
            STAMPS.append(("rows: keys, lookup", *clock()))
            result = await function(self, served, adapter, rows, *args, **kwargs)
            STAMPS.append(("rows done", *clock()))
            return result

        return stamped

    ls, sv = gateway.dense.local_socket, gateway.dense.service
    _wrap(ls._Connection, "data_received", "frame in")
    _wrap_async(ls.LocalSocketServer, "answer", "task runs", "answered")
    _wrap(gateway.requests, "decode_body", "decode", "decoded")
    _wrap(gateway.registry.ModelRegistry, "resolve", "resolve", "resolved")
    _wrap_async(ls, "dense_inputs", "token checks", "checked")
    _wrap(gateway.access.Access, "reserve_answer_bytes", "reserve", "reserved")
    _wrap_async(sv.DenseService, "answer", "service", "service done")
    _wrap(gateway.dense.shared_memory.SharedMemoryWriter, "target", "segment", "segment found")
    sv.DenseService.rows = _rows(sv.DenseService.rows)
    _wrap_async(gateway.dense.row_cache.RowCache, "lookup", "lookup", "looked up")
    _wrap_async(gateway.dense.batcher.RowBatcher, "submit", "batcher", "batcher done")
    engines, host_memories = [backends.mock.MockEngine], [backends.mock.MockHostMemory]
    try:
        import backends.host_copy
        import backends.transformers

        engines.append(backends.transformers.TransformersEngine)
        host_memories.append(backends.host_copy.CudaHostMemory)
    except Exception:  # noqa: BLE001 (no torch: the mock alone)
        pass
    for engine in engines:
        _wrap_async(engine, "next_token_logprobs", "engine", "engine done")
    for host_memory in host_memories:  # the client's rows landing, after the engine call
        _wrap(host_memory, "wait_landed", "landing", "landed")
    _wrap(ls._Connection, "_send", "send", "sent")

    def _dump() -> None:
        if any(stamp[0] == "frame in" for stamp in STAMPS):
            with open(f"{os.environ['STAGE_OUT']}{os.getpid()}", "w") as out:
                out.writelines(f"{name}\t{t}\t{c}\n" for name, t, c in STAMPS)

    def _on_term(*_: object) -> None:
        _dump()
        os._exit(0)

    atexit.register(_dump)
    signal.signal(signal.SIGTERM, _on_term)
