"""How the SGLang engine reaches SGLang: in process, or over HTTP to a server it manages or is given.

Every transport takes the same request: a dict whose keys are `GenerateReqInput` field names
(sglang/srt/managers/io_struct.py), and returns SGLang's own response dicts (`meta_info` & co.).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from backends.errors import AdapterError, RequestRejectedError


class SglangError(RuntimeError):
    """SGLang failed a request for a reason of its own (not the client's parameters)."""


# SGLang's calls that change the weights: the tokenizer manager's method and HTTP path, and its
# request type in sglang/srt/managers/io_struct.py. Each answers (success, message, ...).
WEIGHTS_CALLS = {
    "update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
}


def _base64_bytes(value: Any) -> Any:
    """JSON has no bytes: SGLang's HTTP API takes them (serialized tensors) base64-encoded."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, list):
        return [_base64_bytes(item) for item in value]
    return value


class Transport(Protocol):
    async def generate(self, request: dict[str, Any]) -> dict[str, Any]: ...
    def stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...
    async def load_lora(self, name: str, path: str) -> None: ...
    async def unload_lora(self, name: str) -> None: ...
    async def weights_call(self, name: str, body: dict[str, Any]) -> tuple[bool, str]: ...
    def is_healthy(self) -> bool: ...
    async def aclose(self) -> None: ...


def check_finish(out: dict[str, Any]) -> dict[str, Any]:
    """An `abort` finish (SGLang's way of refusing or failing one request) becomes an exception."""
    if "error" in out:  # a streamed error event
        raise RequestRejectedError(str(out["error"].get("message", out["error"])))
    reason = out.get("meta_info", {}).get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        if reason.get("status_code") == 400:
            raise RequestRejectedError(str(reason.get("message")))
        raise SglangError(f"SGLang aborted the request: {reason.get('message')}")
    return out


# -- in process ---------------------------------------------------------------------------------


class EngineTransport:
    """`sglang.Engine` in this process (CUDA only). Its `async_generate` has no parameters for the
    flat raw-logprob fields, so requests go to its tokenizer manager the way `async_generate` does."""

    def __init__(self, engine: Any) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        self.engine = engine
        self._request_class = GenerateReqInput

    @classmethod
    def start(cls, **server_args: Any) -> EngineTransport:
        import sglang

        return cls(sglang.Engine(**server_args))

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        obj = self._request_class(**{**request, "stream": False})
        try:
            out = await self.engine.tokenizer_manager.generate_request(obj, None).__anext__()
        except ValueError as exc:  # SGLang's own request checks
            raise RequestRejectedError(str(exc)) from exc
        return check_finish(out)

    async def stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        obj = self._request_class(**{**request, "stream": True})
        generator = self.engine.tokenizer_manager.generate_request(obj, None)
        try:
            async for out in generator:
                yield check_finish(out)
        except ValueError as exc:
            raise RequestRejectedError(str(exc)) from exc
        finally:
            await generator.aclose()  # aborts the request when the caller stops early

    async def load_lora(self, name: str, path: str) -> None:
        result = await self.engine.async_load_lora_adapter(name, path)
        if not result.success:
            raise AdapterError(f"adapter {name!r} does not fit this model: {result.error_message}")

    async def unload_lora(self, name: str) -> None:
        result = await self.engine.async_unload_lora_adapter(name)
        if not result.success:
            raise AdapterError(f"cannot unload adapter {name!r}: {result.error_message}")

    async def weights_call(self, name: str, body: dict[str, Any]) -> tuple[bool, str]:
        """The tokenizer manager's own coroutine: the Engine's synchronous wrappers of these run
        their own event loop to completion, which cannot run inside the gateway's."""
        from sglang.srt.managers import io_struct

        request = getattr(io_struct, WEIGHTS_CALLS[name])(**body)
        result = await getattr(self.engine.tokenizer_manager, name)(request, None)
        return bool(result[0]), str(result[1])

    def is_healthy(self) -> bool:
        return not getattr(self.engine.tokenizer_manager, "gracefully_exit", False)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)  # blocks until its scheduler processes exit


# -- over HTTP ----------------------------------------------------------------------------------


class HttpTransport:
    """SGLang's native HTTP API (`/generate`, `/load_lora_adapter`, ...) over one pooled client."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, max_connections: int = 256) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self.server: ManagedServer | None = None  # set when this transport owns the server
        self._reachable = True

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            response = await self.client.post(path, json=body)
        except httpx.TransportError as exc:
            self._reachable = False
            raise SglangError(f"SGLang server at {self.base_url} unreachable: {exc!r}") from exc
        self._reachable = True
        return response

    @staticmethod
    def _raise_for(response: httpx.Response, text: str) -> None:
        try:
            error = json.loads(text).get("error", text)
        except (ValueError, AttributeError):
            error = text
        message = error.get("message", error) if isinstance(error, dict) else error
        if response.status_code == 400:
            raise RequestRejectedError(str(message))
        raise SglangError(f"SGLang answered {response.status_code}: {message}")

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        response = await self._post("/generate", {**request, "stream": False})
        if response.status_code != 200:
            self._raise_for(response, response.text)
        return check_finish(response.json())

    async def stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        body = {**request, "stream": True}
        try:
            # Leaving this block closes the connection, and SGLang aborts the request on disconnect.
            async with self.client.stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    self._raise_for(response, (await response.aread()).decode(errors="replace"))
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield check_finish(json.loads(data))
        except httpx.TransportError as exc:
            self._reachable = False
            raise SglangError(f"SGLang server at {self.base_url} unreachable: {exc!r}") from exc

    async def _lora(self, path: str, body: dict[str, Any]) -> None:
        response = await self._post(path, body)
        if response.status_code != 200:
            try:
                message = response.json().get("error_message") or response.text
            except ValueError:
                message = response.text
            raise AdapterError(f"adapter {body['lora_name']!r}: {message}")

    async def load_lora(self, name: str, path: str) -> None:
        await self._lora("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora(self, name: str) -> None:
        await self._lora("/unload_lora_adapter", {"lora_name": name})

    async def weights_call(self, name: str, body: dict[str, Any]) -> tuple[bool, str]:
        """SGLang's endpoint of that name: 200 or 400, both with `success` and `message`."""
        if name not in WEIGHTS_CALLS:
            raise ValueError(f"not one of SGLang's weights calls: {name}")
        response = await self._post("/" + name, {key: _base64_bytes(v) for key, v in body.items()})
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or "success" not in answer:
            self._raise_for(response, response.text)
        return bool(answer["success"]), str(answer.get("message", ""))

    def is_healthy(self) -> bool:
        if self.server is not None and not self.server.alive():
            return False
        return self._reachable

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.server is not None:
            self.server.stop()


# -- a managed server process -------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on the loopback interface now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    """`python -m sglang.launch_server` (or any command taking the same options) as a child process
    logging to a file, like TorchRL's AsyncSGLang: early crashes and health timeouts raise with
    the log's tail, and stop() terminates, then kills."""

    def __init__(self, command: Sequence[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with log_path.open("w") as log_file:
            self.process = subprocess.Popen(
                [*command, "--host", "127.0.0.1", "--port", str(port)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,  # its own process group, so stop() reaches its workers
            )

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise SglangError(
                    f"SGLang server exited with {self.process.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise SglangError(
            f"SGLang server not healthy after {timeout_s} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 30.0) -> None:
        if not self.alive():
            return
        self._signal(15)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._signal(9)
            self.process.wait()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
