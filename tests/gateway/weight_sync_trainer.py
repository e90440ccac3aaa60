"""A trainer process for tests/gateway/test_weight_sync.py: TorchRL's side of SGLang's weight sync,
on the CPU (gloo), driven by one JSON command per line on standard input, each answered by one JSON
line on standard output.

It forms the group with TorchRL's own `_init_custom_process_group` and `init_all_workers_group`'s
steps, and sends an update with `SGLangCollectiveTransport`'s own HTTP steps (pause, poll
`/get_load` until nothing runs, the update request while it broadcasts, continue) and its payload;
only the broadcasts, which TorchRL makes from CUDA, are made here from the CPU, in the same order.
Its weights are the default model's with one layer scaled, never written to disk.

    python tests/gateway/weight_sync_trainer.py <gateway url> <model directory>

Commands:
    {"op": "init"}     form the group and ask the gateway to join it (TorchRL's body)
    {"op": "update", "scale": 1.5, "mode": "retract", "version": null, "corrupt": null, "die_after": null}
                       layer 3's down_proj times `scale`, sent with pause mode `mode`; `corrupt`
                       ("name", "shape", "dtype") announces and broadcasts one tensor so that it no
                       longer fits; `die_after` N: exit after broadcasting N tensors
    {"op": "exit"}     destroy the group and exit
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import requests
import torch
from torchrl.modules.llm.backends.sglang.sglang_utils import dtype_to_str
from torchrl.weight_update.llm.sglang_nccl import (
    SGLangCollectiveTransport,
    _init_custom_process_group,
    get_model_metadata,
)
from transformers import AutoModelForCausalLM

SCALED = "model.layers.3.mlp.down_proj.weight"  # the tensor the `scaled` fixture scales
TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    def __init__(self, url: str, model_dir: str) -> None:
        self.url = url
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.original = self.model.state_dict()[SCALED].clone()
        self.metadata = get_model_metadata(self.model)  # TorchRL's: state_dict names, dtypes, shapes
        self.transport = SGLangCollectiveTransport(
            server_url=url, master_address="127.0.0.1", master_port=free_port(), rank=0, world_size=2
        )
        self.group: Any = None

    def init(self) -> dict[str, Any]:
        """init_all_workers_group's steps, with gloo: the group formed in a thread, the gateway
        asked to join it 0.3 s later."""
        transport = self.transport
        name = f"weight_update_group_{uuid.uuid4().hex[:8]}"
        formed: list[Any] = []

        def form() -> None:
            formed.append(
                _init_custom_process_group(
                    backend="gloo",
                    init_method=f"tcp://127.0.0.1:{transport.master_port}",
                    world_size=transport.world_size,
                    rank=0,
                    group_name=name,
                    timeout=TIMEOUT,
                )
            )

        thread = threading.Thread(target=form, daemon=True)
        thread.start()
        time.sleep(0.3)
        body = {
            "master_address": "127.0.0.1",
            "master_port": transport.master_port,
            "rank_offset": 1,
            "world_size": transport.world_size,
            "group_name": name,
        }
        answer = requests.post(f"{self.url}/init_weights_update_group", json=body, timeout=120)
        thread.join(timeout=120)
        if formed:
            self.group = transport._comm_group = formed[0]
            transport._group_name = name
            transport._model_metadata = self.metadata
        return {"status": answer.status_code, "body": answer.json(), "group": name, "formed": bool(formed)}

    def _announcement(
        self, corrupt: str | None
    ) -> tuple[list[str], list[str], list[list[int]], list[torch.Tensor]]:
        """send_weights' lists, in its order, and the tensors to broadcast."""
        weights = self.model.state_dict()
        names = list(self.metadata)
        tensors = [weights[name] for name in names]
        if corrupt == "name":
            names[5] = names[5].replace("weight", "weights")
        elif corrupt == "shape":
            tensors[5] = tensors[5][:-1].clone()
        elif corrupt == "dtype":
            tensors[5] = tensors[5].to(torch.int32)
        return names, [dtype_to_str(t.dtype) for t in tensors], [list(t.shape) for t in tensors], tensors

    def update(
        self,
        scale: float,
        mode: str,
        version: str | None = None,
        corrupt: str | None = None,
        die_after: int | None = None,
    ) -> dict[str, Any]:
        with torch.no_grad():
            self.model.state_dict()[SCALED].copy_(self.original * scale)
        transport = self.transport
        transport.pause_mode = mode
        polled: list[int] = []
        running = transport._running_generation_requests

        def record(model_id: str) -> int:
            polled.append(running(model_id))
            return polled[-1]

        transport._running_generation_requests = record  # type: ignore[method-assign]
        names, dtypes, shapes, tensors = self._announcement(corrupt)
        started = time.monotonic()
        transport._pause_generation_for_update("policy")  # POST /pause_generation, poll /get_load
        payload = transport._build_update_payload(names, dtypes, shapes)
        if version is not None:
            payload["weight_version"] = version
        sent = transport._http_executor.submit(
            requests.post, f"{self.url}/update_weights_from_distributed", json=payload, timeout=120
        )
        for index, tensor in enumerate(tensors):
            if die_after is not None and index == die_after:
                os._exit(3)  # mid-broadcast, as a trainer that crashes
            torch.distributed.broadcast(tensor, src=0, group=self.group)
        answer = sent.result(timeout=125)
        transport._continue_generation_after_update("policy")
        return {
            "status": answer.status_code,
            "body": answer.json(),
            "polled": polled,
            "seconds": time.monotonic() - started,
        }

    def exit(self) -> dict[str, Any]:
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
        return {"status": 0}


def main() -> None:
    trainer = Trainer(sys.argv[1], sys.argv[2])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            answer = getattr(trainer, op)(**command)
        except Exception as exc:  # reported to the test, which decides
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
        if op == "exit":
            return


if __name__ == "__main__":
    main()
