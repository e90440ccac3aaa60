"""A grammar compile worker: a process of its own that does the untrusted part of a compile.

Started by backends/grammar/pool.py as `python -m backends.grammar.worker`; it speaks frames on
its stdin and stdout, each a 4-byte big-endian length and a MessagePack body:

    in:  {"tokenizer": <llguidance tokenizer JSON>, "n_vocab": int, "eos": [int], "stack_bytes": int}
    out: {"ready": true}
    in:  [kind, source]                  one per job, the next only after the answer
    out: ["ok", <llguidance grammar text>] or ["error", <message on one line>]

For each job it reads the grammar (JSON schema, GBNF converted to Lark, regex), builds the
matcher under the explicit parser limits and computes its first mask, so a grammar refused only
at its first token is refused here. A grammar that crashes llguidance (a stack overflow in its
native code) or runs past its time kills only this process; its parent answers for it. It ends
when its stdin closes or its parent is gone.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import msgspec
import numpy as np

FRAME_HEADER = struct.Struct(">I")
PARENT_POLL_S = 0.5  # how soon a worker whose parent died notices and exits
PROBED_FIRST_TOKENS = 16  # first tokens taken, each on a copy of the matcher, before a grammar passes


def read_frame(stream: BinaryIO) -> bytes | None:
    """One frame's body; None at the end of the stream."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    body = stream.read(size)
    return body if len(body) == size else None


def write_frame(stream: BinaryIO, message: object) -> None:
    body = msgspec.msgpack.encode(message)
    stream.write(FRAME_HEADER.pack(len(body)) + body)
    stream.flush()


def first_token_error(matcher: Any, n_vocab: int) -> str | None:
    """Why generation under `matcher` would fail at its first or second token, as far as
    PROBED_FIRST_TOKENS of its allowed first tokens (spread over the vocabulary) tell; None if
    none fails. Some limits (a rule's alternatives) bite only once a token is taken."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
    if matcher.is_error():
        return matcher.get_error()
    allowed = np.flatnonzero(bits[:n_vocab])
    if allowed.size == 0:
        return "the grammar allows no text"
    picks = np.unique(np.linspace(0, allowed.size - 1, min(PROBED_FIRST_TOKENS, allowed.size)).astype(int))
    for token in allowed[picks]:
        probe = matcher.deep_copy()
        if probe.consume_token(int(token)) and not probe.is_stopped():
            probe.compute_bitmask()
        if probe.is_error():
            return probe.get_error()
    return None


def compile_grammar(tokenizer: Any, n_vocab: int, kind: str, source: str) -> list[str]:
    """["ok", grammar text] where the grammar compiles and its first tokens hold, else
    ["error", why]."""
    import llguidance

    from backends.errors import GrammarError
    from backends.grammar.text import grammar_text, one_line_error, parser_limits
    from backends.types import Grammar

    try:
        text = grammar_text(Grammar(kind, source))
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
        error = matcher.get_error() if matcher.is_error() else first_token_error(matcher, n_vocab)
        if error is not None:
            return ["error", str(one_line_error(error))]
        return ["ok", text]
    except GrammarError as exc:
        return ["error", str(exc)]
    except Exception as exc:  # noqa: BLE001 (whatever the library raises is the grammar's fault)
        return ["error", str(one_line_error(f"the grammar engine failed: {exc}"))]


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the gateway's to handle; EOF ends us
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing printed by a library may corrupt the frames
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    hello = read_frame(requests)
    if hello is None:
        return
    setup = msgspec.msgpack.decode(hello)
    import llguidance

    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"])
    # Compiles run on a thread with a smaller stack than the gateway's own compile threads, so
    # a grammar that compiles here compiles there too, with room to spare.
    threading.stack_size(setup["stack_bytes"])
    jobs = ThreadPoolExecutor(max_workers=1)
    write_frame(answers, {"ready": True})
    while (frame := read_frame(requests)) is not None:
        kind, source = msgspec.msgpack.decode(frame)
        write_frame(answers, jobs.submit(compile_grammar, tokenizer, setup["n_vocab"], kind, source).result())


if __name__ == "__main__":
    main()
