"""One fixed shape of the decode lane: a transformers `StaticCache` of `slots` rows by `width`
columns, and the step that runs `window` new tokens of every row through the model at once.

Rows are right-aligned at the cache's write column (`column`, which every layer keeps on the
device): a step writes each row's `window` new tokens at columns column..column+window-1, the
last of them each row's last token. The attention mask, built inside the step from each token's
position, keeps for a token at column c the columns c-position..c of its row: whatever lies left
of a row (another row's old tokens, zeros) is hidden, and a padding token (position 0) sees only
itself. On CUDA the step is captured once as a CUDA graph and replayed, so it costs no Python or
kernel launch per layer, and the interpreter lock is free while the GPU runs it.

A window of one token is a decode step (the lane's rows one token longer); a wider window is the
first pass of rows the lane does not hold (new prompts), over the past their cached prefix gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import StaticCache

from backends.transformers.cache_argument import with_cache

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, [rows, heads, columns, head_dim]


class LaneShape:
    def __init__(
        self, model: Any, slots: int, width: int, graphs: bool, forward: Any = None, window: int = 1
    ) -> None:
        self.model = model
        self.forward = model if forward is None else forward  # or torch.compile's version of it
        self.slots, self.width, self.window = slots, width, window
        parameter = next(model.parameters())
        device = parameter.device
        _, kv_heads, head_dim = kv_layout(model)
        self.cache = StaticCache(config=model.config, max_cache_len=width)
        self.cache.early_initialization(slots, kv_heads, head_dim, parameter.dtype, device)
        self.nbytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers)
        self.ids = torch.zeros((slots, window), dtype=torch.long, device=device)
        self.positions = torch.zeros((slots, window), dtype=torch.long, device=device)
        self.columns = torch.arange(width, device=device)
        self.offsets = torch.arange(window, device=device)[:, None]  # a token's column past the write column
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
        at = column + self.offsets  # [window, 1]: each new token's column
        mask = (self.columns >= at - self.positions[:, :, None]) & (self.columns <= at)
        out = self.forward(
            input_ids=self.ids,
            position_ids=self.positions,
            attention_mask=mask[:, None],
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
                self.set_column(0)
                self._forward()
                if self.window == 1:
                    self._gather(self.width)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.set_column(0)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: host memory registered from another thread during capture is no error
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = self._forward()
        if self.window == 1:  # only decode steps gather (SMC's resampling)
            self.gather_graph = torch.cuda.CUDAGraph()
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
        """[slots, vocab] float32 log-probabilities after each row's last token; a graph's output
        is overwritten by its next step."""
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        assert self.out is not None
        return self.out


def kv_bytes(model: Any, slots: int, width: int) -> int:
    layers, kv_heads, head_dim = kv_layout(model)
    itemsize = next(model.parameters()).element_size()
    return 2 * layers * slots * kv_heads * width * head_dim * itemsize


def kv_layout(model: Any) -> tuple[int, int, int]:
    """Layers, key/value heads and head size of the model's attention."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, text.num_key_value_heads, head_dim
