"""The client's stages of each `AsyncGatewayLM.batch_next_token_logprobs`, stamped in the process
that calls it (bench/server_stages.py, around bench/step_parts.py): the call, its keys and the
request, the segment's lease, the exchange over the socket, the answer's matrix, its rows filed in
the client's row cache, the tensor, the return. Each wrapped function is named by reference
(bench/stages/stamps.py)."""

from __future__ import annotations

from bench.stages.stamps import stamp
from logprob_gateway_client import buffer_lru, dense_requests, lm, local_socket, shared_memory

FIRST = "call"


def install() -> None:
    client = lm.AsyncGatewayLM
    stamp(client, client.batch_next_token_logprobs, FIRST, "returned", rows=lambda args: len(args[1]))
    stamp(client, client._request, "request", "requested")
    stamp(shared_memory.SharedSegments, shared_memory.SharedSegments.lease, "lease", "leased")
    # imported into dense_requests: wrapped there
    stamp(dense_requests, dense_requests.encode_request, "encode", "encoded")
    stamp(local_socket.LocalSocket, local_socket.LocalSocket.call, "socket call", "socket answered")
    stamp(client, client._matrix, "matrix", "matrixed")
    stamp(buffer_lru.BufferLRU, buffer_lru.BufferLRU.put_rows, "row cache", "row cache done")
    stamp(lm, lm._as_output, "tensor", "tensor made")
