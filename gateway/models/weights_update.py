"""New weights for a served model while it serves: from a directory, or from a trainer over a
collective the engine has joined. The update waits for the weights' readers (weights_lock.py),
then changes the model's fingerprint, and with it every output-cache key, and its version."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from backends.engine import Collective, Engine, Weights
from backends.errors import WeightsError, WeightsGroupError
from backends.types import AnnouncedTensor, WeightsGroup
from gateway.errors import GatewayError, InvalidRequestError, NotSupportedError, RateLimitError
from gateway.models.fingerprint import weight_files_stat, weights_fingerprint
from gateway.models.served import ServedModel
from gateway.models.to_the_end import to_the_end
from gateway.models.weights_lock import ReadersOutlasted

log = logging.getLogger(__name__)


def _weights_error(exc: WeightsError, param: str) -> GatewayError:
    """New weights that do not fit (nothing changed): 400."""
    return InvalidRequestError(str(exc), param="group_name" if isinstance(exc, WeightsGroupError) else param)


@contextmanager
def _weights_errors(param: str) -> Iterator[None]:
    try:
        yield
    except WeightsError as exc:
        raise _weights_error(exc, param) from None


def _weights(engine: Engine) -> Weights:
    """An engine that cannot take new weights: 501."""
    if engine.weights is None:
        raise NotSupportedError(f"the {type(engine).__name__} cannot load new weights without a restart")
    return engine.weights


def _collective(engine: Engine) -> Collective:
    collective = None if engine.weights is None else engine.weights.collective
    if collective is None:
        raise NotSupportedError(f"the {type(engine).__name__} cannot receive weights over a collective")
    return collective


async def update_weights(
    served: ServedModel, path: Path, version: str | None = None, wait_s: float | None = None
) -> None:
    """New weights of the same architecture from the directory `path`, once the requests
    reading the old ones have finished; the fingerprint (every output-cache key) changes with
    them. Weights that do not fit change nothing (400); an engine that cannot, 501; requests still
    reading after `wait_s`, 429 and nothing changed."""
    engine = served.require_engine()
    weights = _weights(engine)

    def fingerprint() -> str:
        try:
            extra = (served.settings.engines, engine.info.dtype, str(engine.info.vocab_size))
            return weights_fingerprint(path, *extra, *weight_files_stat(path))
        except OSError:  # the files changed since they were loaded: a key no other replica shares
            return hashlib.sha256(f"{served.fingerprint}:disk:{uuid.uuid4().hex}".encode()).hexdigest()

    await to_the_end(
        _replace_weights(
            served, lambda: weights.load(str(path)), fingerprint, version, "model_path", "disk", wait_s
        )
    )
    log.info("model %r: new weights loaded from a directory", served.name)


async def join_weights_group(served: ServedModel, group: WeightsGroup) -> None:
    """The engine joins a trainer's collective, which new weights then come over."""
    collective = _collective(served.require_engine())
    with _weights_errors("group_name"):
        await collective.join(group)


async def leave_weights_group(served: ServedModel, name: str) -> None:
    collective = _collective(served.require_engine())
    with _weights_errors("group_name"):
        await collective.leave(name)


async def update_weights_from_group(
    served: ServedModel, group: str, tensors: Sequence[AnnouncedTensor], version: str | None = None
) -> None:
    """New weights broadcast by a trainer over the collective `group` (the engine has joined
    it), loaded as `update_weights` loads them. Their fingerprint is new and this replica's
    own: nothing says another replica received the same numbers."""
    collective = _collective(served.require_engine())

    def fingerprint() -> str:
        return hashlib.sha256(f"{served.fingerprint}:received:{uuid.uuid4().hex}".encode()).hexdigest()

    await to_the_end(
        _replace_weights(
            served, lambda: collective.receive(group, tensors), fingerprint, version, "names", "distributed"
        )
    )
    log.info("model %r: new weights received over a collective", served.name)


@asynccontextmanager
async def _writing(served: ServedModel, wait_s: float | None) -> AsyncIterator[None]:
    try:
        async with served.weights.writing(wait_s) as held:
            yield held
    except ReadersOutlasted as exc:
        raise RateLimitError(
            f"{exc.running} requests still read the current weights after {exc.wait_s:g} s "
            "(limits.weights_update_wait_s); nothing changed. Pause generation first "
            "(/pause_generation with mode retract or in_place), or retry",
            retry_after=exc.wait_s,
        ) from None


async def _replace_weights(
    served: ServedModel,
    load: Callable[[], Awaitable[None]],
    fingerprint: Callable[[], str],
    version: str | None,
    param: str,
    source: str,
    wait_s: float | None = None,
) -> None:
    """`load` new weights into the engine once no request reads the old ones, then change the
    fingerprint and the version. WeightsError: nothing changed (400, `param` named); an engine
    that cannot, 501; any other failure may have left weights half written, so rows computed
    from then on match no earlier key (an unreadable file, OSError, is then a 400). Callers run
    it `to_the_end`, whatever happens to the request that asked for it."""
    async with _writing(served, wait_s):
        try:
            await load()
        except WeightsError as exc:
            raise _weights_error(exc, param) from None
        except BaseException as exc:
            served.fingerprint = f"{served.fingerprint}:update-failed-{served.weight_updates + 1}"
            served.weight_updates += 1
            if isinstance(exc, OSError):  # unreadable files: the caller's to fix
                reason = exc.strerror or type(exc).__name__
                raise InvalidRequestError(f"the new weights cannot be read: {reason}", param=param) from None
            raise
        served.fingerprint = await asyncio.to_thread(fingerprint)
        served.weight_updates += 1
        served.weight_version = version or str(served.weight_updates)
        served.metrics.weight_updates.labels(served.name, source).inc()
