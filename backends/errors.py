"""What engines raise, as one tree:

    RuntimeError
     └── EngineUnavailableError   the backend's library is missing, or the model cannot load (or serve)
          └── EngineMismatchError  two engines composed into one model do not share a vocabulary
    ValueError
     ├── AdapterError             an adapter does not fit (or is not loaded)
     ├── WeightsError             new weights that do not fit; nothing changed
     │    └── WeightsGroupError   no collective of that name, or one of that name exists already
     ├── RequestRejectedError     a request's parameters beyond a limit of the engine's own
     └── GrammarError             a grammar that is invalid, unenforceable, or too slow to compile

The gateway maps them to HTTP answers in one table (gateway/errors.py) and where it calls them.
"""

from __future__ import annotations


class EngineUnavailableError(RuntimeError):
    """A backend cannot be used here: its library is missing or the model cannot be loaded; or a
    loaded model cannot serve until it is given weights again (backends/composed/)."""


class EngineMismatchError(EngineUnavailableError):
    """The engines composed into one model would not mean the same by a token id (their
    tokenizers or vocabulary sizes differ): a configuration to change, not a load to retry."""


class AdapterError(ValueError):
    """An adapter cannot be loaded into (or unloaded from) this engine; the message says why."""


class WeightsError(ValueError):
    """New weights that this engine cannot load in place (another architecture, a missing or
    misshapen tensor); nothing was changed. The message says why."""


class WeightsGroupError(WeightsError):
    """No collective of that name to receive weights over, or one of that name exists already."""


class RequestRejectedError(ValueError):
    """The engine refuses a request's parameters (a limit of its own); the message says why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class GrammarError(ValueError):
    """A grammar the engine cannot hold generation to: invalid, using a feature the grammar
    engine cannot enforce, or not compiled within the time allowed. The message says why."""
