"""The served models by name: loading them in the background and resolving request model names
(`base:adapter`)."""

from __future__ import annotations

from gateway.errors import ModelNotFoundError
from gateway.metrics import Metrics
from gateway.models.loading import load_model
from gateway.models.served import ServedModel
from gateway.settings import ModelSettings


def parse_model_name(name: str) -> tuple[str, str | None]:
    """`base:adapter` -> ("base", "adapter"); a name without ':' is the base model."""
    base, sep, adapter = name.partition(":")
    return base, (adapter if sep else None)


class ModelRegistry:
    def __init__(self, models: list[ModelSettings], metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics()
        self.models = {m.served_name: ServedModel(m, metrics=self.metrics) for m in models}

    async def load_all(self) -> None:
        """Load every model, one after another (they share the machine); failures are recorded."""
        for served in self.models.values():
            await load_model(served, self.metrics)

    def resolve(self, name: str) -> tuple[ServedModel, str | None]:
        """The served base model and the adapter (None: the base) that a request's `model` names."""
        base, adapter = parse_model_name(name)
        served = self.models.get(base)
        if served is None:
            raise ModelNotFoundError(
                f"model {name!r} does not exist; available: {', '.join(self.models)}", param="model"
            )
        if adapter is not None and adapter not in served.adapters:
            raise ModelNotFoundError(served.no_adapter_message(adapter), param="model")
        return served, adapter

    @property
    def healthy(self) -> bool:
        models = self.models.values()
        return all(m.ready and m.engine is not None and m.engine.status().healthy for m in models)

    async def aclose(self) -> None:
        for served in self.models.values():
            if served.engine is not None:
                await served.engine.aclose()
                served.engine = None
