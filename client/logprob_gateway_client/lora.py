"""genlm's adapter calls on the gateway client: `set_lora`/`clear_lora` choose the adapter later
calls use, `add_new_lora`/`remove_lora` load and unload adapters on the gateway through its admin
endpoints. A mixin of `logprob_gateway_client.AsyncGatewayLM`. Needs only httpx and msgspec.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from logprob_gateway_client.wire import raise_for_error


class LoraManagement:
    """Adapter selection and management, with genlm-backend's signatures. Uses the client's
    `model` (the model that calls without a `lora_name` use), `_admin_key`, `_sync` (its httpx
    client) and `clear_cache`."""

    model: str
    _admin_key: str | None
    _sync: httpx.Client

    @property
    def _base_model(self) -> str:
        return self.model.partition(":")[0]

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Later calls without a `lora_name` use adapter `lora_name` (`model:lora_name` on the
        gateway); a call's own `lora_name` still wins. genlm's signature: `lora_path` is accepted
        and ignored, as the gateway serves adapters by name (loaded by its configuration or by
        `add_new_lora`). Sends nothing: a name the gateway does not serve fails at the first call
        that uses it, with the gateway's 404."""
        self.model = f"{self._base_model}:{lora_name}"

    def clear_lora(self) -> None:
        """Later calls without a `lora_name` use the base model, with no adapter (also when the
        client was built for `base:adapter`)."""
        self.model = self._base_model

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Load the adapter at `lora_path` (on the gateway's host, inside the model's
        `adapters_root`; relative paths are relative to it) as `lora_name`, through
        `POST /v1/load_lora_adapter`. Does not select it: pass `lora_name=` or call `set_lora`.
        Needs the client's `admin_key` (PermissionError before any request without one). The
        gateway refuses a name it already serves (GatewayClientError 400, its message kept),
        where genlm's local backends replace the adapter: `remove_lora` it first. Clears the
        client's row cache, so no row of an earlier adapter of that name is served."""
        self._admin("add_new_lora", "/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def remove_lora(self, lora_name: str) -> None:
        """Unload adapter `lora_name` through `POST /v1/unload_lora_adapter`; later calls for it
        fail with the gateway's 404. Needs the client's `admin_key` (PermissionError before any
        request without one). Clears the client's row cache, so none of its rows are served."""
        self._admin("remove_lora", "/v1/unload_lora_adapter", {"lora_name": lora_name})

    def _admin(self, method: str, path: str, body: dict[str, Any]) -> None:
        if not self._admin_key:
            raise PermissionError(
                f"{method} needs the gateway's admin key: AsyncGatewayLM(..., admin_key=...)"
            )
        response = self._sync.post(
            path,
            content=msgspec.json.encode({**body, "model": self._base_model}),
            headers={
                "Authorization": f"Bearer {self._admin_key}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        raise_for_error(response)
        self.clear_cache()
