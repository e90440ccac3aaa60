"""Loaded by every Python process whose path holds this folder (bench/server_stages.py puts it
there for a bench and the gateways it starts): in a process that serves dense calls over the local
socket, it stamps the time at each stage of every call; in the bench (bench/step_parts.py), at each
stage of every `AsyncGatewayLM.batch_next_token_logprobs`. It writes the stamps to
$STAGE_OUT<pid> when the process ends. A measuring harness: it wraps the gateway's and the
client's functions, and is never imported by either."""

import atexit
import functools
import os
import signal
import sys

if os.environ.get("STAGE_OUT") and any(arg.endswith("step_parts.py") for arg in sys.argv):
    from _stamps import STAMPS, clock, dump, wrap, wrap_async

    import logprob_gateway_client.buffer_lru
    import logprob_gateway_client.lm
    import logprob_gateway_client.local_socket
    import logprob_gateway_client.shared_memory

    lm = logprob_gateway_client.lm
    batch = lm.AsyncGatewayLM.batch_next_token_logprobs

    @functools.wraps(batch)
    async def stamped_batch(self, token_ids_list, lora_name=None):
        STAMPS.append((f"rows={len(token_ids_list)}", 0.0, 0.0))
        STAMPS.append(("call", *clock()))
        result = await batch(self, token_ids_list, lora_name)
        STAMPS.append(("returned", *clock()))
        return result

    lm.AsyncGatewayLM.batch_next_token_logprobs = stamped_batch
    wrap(lm.AsyncGatewayLM, "_request", "request", "requested")
    wrap(logprob_gateway_client.shared_memory.SharedSegments, "lease", "lease", "leased")
    wrap(lm, "encode_request", "encode", "encoded")
    wrap_async(logprob_gateway_client.local_socket.LocalSocket, "call", "socket call", "socket answered")
    wrap(lm.AsyncGatewayLM, "_matrix", "matrix", "matrixed")
    wrap(logprob_gateway_client.buffer_lru.BufferLRU, "put_rows", "row cache", "row cache done")
    wrap(lm, "_as_output", "tensor", "tensor made")
    atexit.register(dump, "call")
elif os.environ.get("STAGE_OUT"):
    from _stamps import STAMPS, clock, dump, wrap, wrap_async

    import backends.mock
    import gateway.access
    import gateway.dense.batcher
    import gateway.dense.local_socket
    import gateway.dense.row_cache
    import gateway.dense.service
    import gateway.dense.shared_memory
    import gateway.models.registry
    import gateway.requests

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
    wrap(ls._Connection, "data_received", "frame in")
    wrap_async(ls.LocalSocketServer, "answer", "task runs", "answered")
    wrap(gateway.requests, "decode_body", "decode", "decoded")
    wrap(gateway.models.registry.ModelRegistry, "resolve", "resolve", "resolved")
    wrap_async(ls, "dense_inputs", "token checks", "checked")
    wrap(gateway.access.Access, "reserve_answer_bytes", "reserve", "reserved")
    wrap_async(sv.DenseService, "answer", "service", "service done")
    wrap(gateway.dense.shared_memory.SharedMemoryWriter, "target", "segment", "segment found")
    sv.DenseService.rows = _rows(sv.DenseService.rows)
    wrap_async(gateway.dense.row_cache.RowCache, "lookup", "lookup", "looked up")
    wrap_async(gateway.dense.batcher.RowBatcher, "submit", "batcher", "batcher done")
    engines, host_memories = [backends.mock.MockEngine], [backends.mock.MockHostMemory]
    try:
        import backends.transformers.engine
        import backends.transformers.host_copy

        engines.append(backends.transformers.engine.TransformersEngine)
        host_memories.append(backends.transformers.host_copy.CudaHostMemory)
    except Exception:  # noqa: BLE001 (no torch: the mock alone)
        pass
    for engine in engines:
        wrap_async(engine, "next_token_logprobs", "engine", "engine done")
    for host_memory in host_memories:  # the client's rows landing, after the engine call
        wrap(host_memory, "wait_landed", "landing", "landed")
    wrap(ls._Connection, "_send", "send", "sent")

    def _on_term(*_: object) -> None:
        dump("frame in")
        os._exit(0)

    atexit.register(dump, "frame in")
    signal.signal(signal.SIGTERM, _on_term)
