"""The stand-in SGLang server's weights (sglang_standin.py): SGLang 0.5.17's five weight endpoints,
answered as its http_server.py answers them (200 or 400, `success` and `message`, and for a load
from disk `num_paused_requests`), each body first built into sglang's own request type and through
the msgpack its scheduler receives (a field it lacks, or of another type, is a 422 as FastAPI's).

The fake model's weights are a version string that `distribution()` hashes in: a load from disk
sets it from the directory's files; an update over a collective joins, as SGLang's scheduler does,
a real torch.distributed group (SGLang's own `init_custom_process_group`), receives every announced
tensor from rank 0's broadcasts, and sets it from the tensors' bytes; an update from tensors
reads them with SGLang's own deserializer and does the same. An update waits for the
requests in flight, as SGLang's tokenizer manager does under its writer lock.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path

WEIGHTS_PATHS = (
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/update_weights_from_tensor",
)
_TYPES = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
}


def weights_version(files: dict[str, bytes]) -> str:
    """The fake model's weights from named bytes: a checkpoint's files, or received tensors."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()[:16]


def directory_version(path: Path) -> str:
    """What a load of the checkpoint directory `path` makes the stand-in's weights; ValueError for
    a safetensors file whose header does not parse."""
    files = {f.name: f.read_bytes() for f in [path / "config.json", *sorted(path.glob("*.safetensors"))]}
    for name, data in files.items():
        if name.endswith(".safetensors"):
            size = int.from_bytes(data[:8], "little")
            try:
                json.loads(data[8 : 8 + size])
            except ValueError:
                raise ValueError(f"Error while deserializing header of {name}: invalid JSON") from None
    return weights_version(files)


class Weights:
    def __init__(self, model_path: Path, validate: bool) -> None:
        self.version = ""  # "": the weights the server started with
        self.model_path = str(model_path)
        self._original: str | None = None  # directory_version of those, once asked
        self.validate = validate
        self.groups: dict[str, object] = {}  # name -> torch ProcessGroup
        self._in_flight = 0
        self._updating = False
        self._changed = threading.Condition()

    @contextmanager
    def serving(self):
        """Around a /generate: held back while an update runs; an update waits for it."""
        with self._changed:
            self._changed.wait_for(lambda: not self._updating)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    @contextmanager
    def _updating_alone(self):
        with self._changed:
            self._changed.wait_for(lambda: not self._updating and not self._in_flight)
            self._updating = True
        try:
            yield
        finally:
            with self._changed:
                self._updating = False
                self._changed.notify_all()

    def _request(self, path: str, body: dict):
        """The body as sglang's request type, as its scheduler receives it (msgpack)."""
        import msgspec
        from sglang.srt.managers import io_struct

        request_class = getattr(io_struct, _TYPES[path])
        return msgspec.msgpack.decode(msgspec.msgpack.encode(request_class(**body)), type=request_class)

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        """(HTTP status, answer) of SGLang's endpoint `path` for `body`."""
        if path == "/update_weights_from_tensor":  # FastAPI decodes the base64 (Base64Bytes)
            payloads = body.get("serialized_named_tensors")
            if isinstance(payloads, list) and all(isinstance(p, str) for p in payloads):
                body = {**body, "serialized_named_tensors": [base64.b64decode(p) for p in payloads]}
        if self.validate:
            try:
                self._request(path, body)
            except Exception as exc:  # FastAPI's validation failure
                return 422, {"detail": f"{type(exc).__name__}: {exc}"}
        handler = getattr(self, path.strip("/"))
        success, message, *more = handler(body)
        answer = {"success": success, "message": message}
        if path == "/update_weights_from_disk":
            answer["num_paused_requests"] = more[0]
        return (200 if success else 400), answer

    def update_weights_from_disk(self, body: dict):
        path = Path(body["model_path"])
        with self._updating_alone():
            try:
                version = directory_version(path)
                if self._original is None:
                    self._original = directory_version(Path(self.model_path))
            except OSError as exc:
                return False, f"Failed to get weights iterator: {exc}.", 0
            except ValueError as exc:
                return False, f"Failed to update weights: {exc}.\nRolling back to original weights.", 0
            self.version = "" if version == self._original else version
            self.model_path = str(path)
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return True, message, 0

    def init_weights_update_group(self, body: dict):
        from sglang.srt.utils.common import init_custom_process_group

        host, port = body["master_address"], body["master_port"]
        host = f"[{host}]" if ":" in host else host
        try:
            self.groups[body.get("group_name", "weight_update_group")] = init_custom_process_group(
                backend=body.get("backend", "nccl"),
                init_method=f"tcp://{host}:{port}",
                world_size=body["world_size"],
                rank=body["rank_offset"],
                group_name=body.get("group_name", "weight_update_group"),
            )
        except Exception as exc:
            return False, f"Failed to initialize custom process group: {exc}."
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(self, body: dict):
        import torch

        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:  # SGLang's scheduler asserts this, and dies of it
            print(f"AssertionError: Group {name} not in {list(self.groups)}", flush=True)
            os._exit(70)
        with self._updating_alone():
            try:
                received = {}
                for tensor, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                    buffer = torch.empty(shape, dtype=getattr(torch, dtype))
                    torch.distributed.broadcast(buffer, src=0, group=self.groups[name])
                    received[tensor] = buffer.contiguous().view(torch.uint8).numpy().tobytes()
            except Exception as exc:
                return False, (
                    f"Failed to update parameter online: {exc}. The full weights of the ModelRunner "
                    "are partially updated. Please discard the whole weights."
                )
            self.version = weights_version({"": self.version.encode(), **received})
        message = "Succeeded to update parameter online."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return True, message

    def update_weights_from_tensor(self, body: dict):
        """Rank 0's payload read as SGLang's weight updater reads it (its own deserializer, which
        refuses what it does not know), the tensors hashed into the weights."""
        import torch
        from sglang.srt.utils.common import MultiprocessingSerializer

        with self._updating_alone():
            try:
                tensors = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
                received = {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in tensors}
            except Exception as exc:
                return False, f"Failed to update weights: {type(exc).__name__}: {exc}"
            self.version = weights_version({"": self.version.encode(), **received})
        return True, "Success"

    def destroy_weights_update_group(self, body: dict):
        import torch

        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        torch.distributed.destroy_process_group(group)
        return True, "Succeeded to destroy custom process group."
