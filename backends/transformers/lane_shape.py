"""One shape of the decode lane (backends/transformers/decode_lane.py): a transformers `StaticCache`
of `slots` rows by `width` columns, and the step that extends each of its rows by a token, on CUDA
replayed from a CUDA graph captured once (with torch.compile's fused kernels where the lane is
compiled)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import StaticCache

from backends.transformers.cache_argument import with_cache

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, [rows, heads, columns, head_dim]


class LaneShape:
    """One static cache of slots x width and the step that extends each of its rows by a token."""

    def __init__(self, model: Any, slots: int, width: int, graphs: bool, forward: Any = None) -> None:
        self.model = model
        self.forward = model if forward is None else forward  # or torch.compile's version of it
        self.slots, self.width = slots, width
        parameter = next(model.parameters())
        device = parameter.device
        _, kv_heads, head_dim = kv_layout(model)
        self.cache = StaticCache(config=model.config, max_cache_len=width)
        self.cache.early_initialization(slots, kv_heads, head_dim, parameter.dtype, device)
        self.nbytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers)
        self.ids = torch.zeros((slots, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((slots, 1), dtype=torch.long, device=device)
        self.columns = torch.arange(width, device=device)
        self.parents = torch.arange(slots, device=device)  # slot i takes the rows of slot parents[i]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.gather_graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        if graphs:
            self._capture(device)

    @property
    def layers(self) -> list[KV]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def set_column(self, column: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(column)

    def _forward(self) -> torch.Tensor:
        column = self.cache.layers[0].cumulative_length  # where this step writes, on the device
        mask = (self.columns >= column - self.positions) & (self.columns <= column)
        out = self.forward(
            input_ids=self.ids,
            position_ids=self.positions,
            attention_mask=mask[:, None, None, :],
            **with_cache(self.cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return torch.log_softmax(out.logits[:, -1].float(), dim=-1)

    def _gather(self, columns: int) -> None:
        for layer in self.cache.layers:
            layer.keys[:, :, :columns] = layer.keys[self.parents, :, :columns]
            layer.values[:, :, :columns] = layer.values[self.parents, :, :columns]

    def _capture(self, device: torch.device) -> None:
        # Warm-up runs on a side stream first (kernel selection, workspaces), as CUDA graphs ask;
        # they write at columns the next real step overwrites or masks, and gather in place.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
                self._gather(self.width)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph, self.gather_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: host memory registered from another thread during capture is no error
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = self._forward()
        with torch.cuda.graph(self.gather_graph, capture_error_mode="thread_local"):
            self._gather(self.width)  # every column: a graph has one shape

    def gather(self, parents: Sequence[int], columns: int) -> None:
        """Slot i takes the keys/values of slot parents[i] (the rest stay), in the first `columns`."""
        index = np.arange(self.slots)
        index[: len(parents)] = parents
        self.parents.copy_(torch.from_numpy(index))
        if self.gather_graph is None:
            self._gather(columns)
        else:
            self.gather_graph.replay()

    def step(self) -> torch.Tensor:
        """[slots, vocab] float32 log-probabilities; a graph's output is overwritten by its next step."""
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        assert self.out is not None
        return self.out


def compiled_forward(model: Any) -> Any:
    import torch._dynamo.config
    import torch.fx.experimental._config

    # Rounded between fused operations as the eager model rounds (bfloat16 after each), so the
    # lane's rows stay as close to a plain forward pass as eager ones.
    compiled = torch.compile(model, dynamic=True, options={"emulate_precision_casts": True})

    def forward(**kwargs: Any) -> Any:
        # Traced without "duck" sizes: dynamo would take two sizes that happen to be equal when
        # it first traces (8 slots and 8 key/value heads; 64 columns and a head of 64) for one,
        # making the lane's slots or width a constant, and trace the whole model again at the
        # first shape where they differ (docs/performance.md has what that cost).
        # With floats specialised from the start: dynamic=True otherwise traces the model's float
        # attributes (norm epsilons, attention scales) as symbols, then specialises them and
        # traces the whole model a second time.
        with (
            torch.fx.experimental._config.patch(use_duck_shape=False),
            torch._dynamo.config.patch(specialize_float=True),
        ):
            return compiled(**kwargs)

    return forward


def kv_bytes(model: Any, slots: int, width: int) -> int:
    layers, kv_heads, head_dim = kv_layout(model)
    itemsize = next(model.parameters()).element_size()
    return 2 * layers * slots * kv_heads * width * head_dim * itemsize


def kv_layout(model: Any) -> tuple[int, int, int]:
    """Layers, key/value heads and head size of the model's attention."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, text.num_key_value_heads, head_dim
