"""Tensors handed from one engine to another on the same device (a composed model's dense engine
to its generation engine), as the receiving engine's processes read them: pickled by torch's
ForkingPickler, as SGLang's MultiprocessingSerializer does. A CUDA tensor travels as an IPC
handle to its memory, so the receiver copies from the sender's memory on the GPU; a CPU tensor as
shared memory, into which it is copied first (sharing it would move the sender's own storage)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any


def pickled(tensors: Sequence[tuple[str, Any]]) -> bytes:
    """`tensors` ((name, torch tensor) pairs) as one payload the receiving process unpickles."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 (registers torch's reductions with ForkingPickler)

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([(name, t if t.is_cuda else t.clone()) for name, t in tensors])
    return buffer.getvalue()
