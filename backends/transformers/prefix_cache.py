"""KVPrefixTrie: attention keys/values by (adapter, token prefix), bounded in bytes, for dense rows.

Workloads such as sequential Monte Carlo ask for rows that grow by one token per call. With the
K/V of a row's longest cached prefix at hand, the engine computes only the row's new tokens.

Storage. The K/V tensors of one batched forward pass are kept as they come out of the model, a
`KVBlock`: [batch, kv_heads, width, head_dim] per layer, each row right-aligned (row r's n tokens
in columns width-n..width-1). An entry is a view of one row of a block, so storing copies nothing;
a block's memory goes when its last entry goes, and the byte budget counts whole blocks
(least recently used entries are evicted until the live blocks fit).

Lookup. One token trie per adapter. The K/V of a position depend only on the tokens up to it, so
an entry serves every prefix of its tokens: entries sit on leaves only, an entry whose tokens are
a prefix of a newer one is dropped when that one is stored, and the longest cached prefix of a row
is found by walking its tokens, O(len(row)). A row that is an entry's tokens, or those and one
more token (a generation step, an SMC extension), is found by its key instead (its int32 bytes,
backends/rows.py, as the row came: hashed in C, in the adapter's own index of leaves), so a
stream's step costs the same however long the stream is, and its ids stay as they came (int32)
unless a walk needs them.

Not thread-safe: the engine uses it from its one worker thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backends.rows import parent_key, row_key

KV = tuple[torch.Tensor, torch.Tensor]  # (keys, values) of one layer: [batch, heads, width, head_dim]
Tokens = np.ndarray | Sequence[int]  # a row's ids: int32 as they came, or a list


class KVBlock:
    """The K/V of every layer after one forward pass; rows right-aligned."""

    __slots__ = ("layers", "nbytes", "rows", "width", "live")

    def __init__(self, layers: list[KV]) -> None:
        self.layers = layers
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        self.rows, _, self.width, _ = layers[0][0].shape
        self.live = 0  # entries viewing this block


class _Node:
    __slots__ = ("children", "parent", "token", "depth", "entry")

    def __init__(self, parent: _Node | None, token: int) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.token = token
        self.depth = 0 if parent is None else parent.depth + 1
        self.entry: Entry | None = None


class Entry:
    """The K/V of the tokens on the path to `leaf`: columns start..start+leaf.depth of `row` of `block`."""

    __slots__ = ("adapter", "block", "row", "start", "leaf", "key")

    def __init__(
        self, adapter: str | None, block: KVBlock, row: int, start: int, leaf: _Node, key: bytes
    ) -> None:
        self.adapter = adapter
        self.block = block
        self.row = row
        self.start = start
        self.leaf = leaf
        self.key = key  # its tokens' key


@dataclass
class KVPrefixTrieStats:
    lookups: int = 0  # rows looked up
    hits: int = 0  # rows that found a cached prefix
    reused_tokens: int = 0  # tokens whose K/V came from the cache (set by the engine)
    computed_tokens: int = 0  # tokens run through the model (set by the engine)
    evictions: int = 0  # entries dropped for the byte budget


class KVPrefixTrie:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0  # bytes of the blocks that live entries view
        self.held_elsewhere = 0  # bytes of this budget that others hold (the decode lane's shapes)
        self.stats = KVPrefixTrieStats()
        self._roots: dict[str | None, _Node] = {}
        self._lru: OrderedDict[Entry, None] = OrderedDict()
        self._leaves: dict[str | None, dict[bytes, _Node]] = {}  # per adapter, each entry's leaf by key

    def __len__(self) -> int:
        return len(self._lru)

    def match(
        self, adapter: str | None, tokens: Tokens, key: bytes | None = None
    ) -> tuple[Entry | None, int]:
        """The entry holding the longest cached prefix of `tokens` (whose key is `key`), and that
        prefix's length."""
        self.stats.lookups += 1
        key = row_key(tokens) if key is None else key
        # an entry's leaf has no children: the row is its tokens, or those and a token more
        leaves = self._leaves.get(adapter)
        node = None if leaves is None else leaves.get(key) or leaves.get(parent_key(key))
        if node is None:
            node = self._walk(adapter, tokens)
            if node is None:
                return None, 0
        depth = node.depth
        if depth == 0:
            return None, 0
        while node.entry is None:  # an inner node: any leaf below it holds its tokens too
            node = next(iter(node.children.values()))
        self._lru.move_to_end(node.entry)
        self.stats.hits += 1
        return node.entry, depth

    def _walk(self, adapter: str | None, tokens: Tokens) -> _Node | None:
        """The deepest node on the path of `tokens`; None without a trie for `adapter`."""
        node = self._roots.get(adapter)
        if node is None:
            return None
        for token in _ints(tokens):
            child = node.children.get(token)
            if child is None:
                break
            node = child
        return node

    def gather(self, picks: Sequence[tuple[Entry | None, int]], width: int) -> list[KV]:
        """Per layer, K/V [len(picks), heads, width, head_dim]: row i holds the first n_i cached
        positions of entry_i, right-aligned (picks[i] = (entry_i, n_i)); before them zeros, or
        whatever the block held there, which the pass's attention mask hides."""
        # Rows that read the same columns of the same block are copied with one op per layer.
        groups: dict[tuple[int, int, int], tuple[KVBlock, list[int], list[int]]] = {}
        for i, (entry, n) in enumerate(picks):
            if n:
                assert entry is not None
                key = (id(entry.block), entry.start, n)
                groups.setdefault(key, (entry.block, [], []))
                groups[key][1].append(i)
                groups[key][2].append(entry.row)
        parts = [(block, dst, src, start, n) for (_, start, n), (block, dst, src) in groups.items()]
        blocks = {id(block) for block, *_ in parts}
        if len(blocks) == 1 and len(picks) == parts[0][0].rows:
            block = parts[0][0]
            rows_in_order = sorted(i for _, dst, *_ in parts for i in dst) == list(range(block.rows))
            if (
                rows_in_order
                and all(dst == src for _, dst, src, _, _ in parts)
                and all(start + n == block.width and width <= block.width for _, _, _, start, n in parts)
            ):
                # Every row of the last pass, one token longer (a generation step of every stream,
                # an SMC step without resampling): its columns as they lie, no copy.
                edge = block.width
                return [(k[:, :, edge - width : edge], v[:, :, edge - width : edge]) for k, v in block.layers]
        if len(parts) == 1 and parts[0][4] == width and len(parts[0][1]) == len(picks):
            block, _, src, start, n = parts[0]  # every row, no padding: slices of one block
            if src == list(range(block.rows)):  # ... in the block's own order: views, no copy
                return [(k[:, :, start : start + n], v[:, :, start : start + n]) for k, v in block.layers]
            index = torch.tensor(src, device=block.layers[0][0].device)
            return [
                (
                    k[:, :, start : start + n].index_select(0, index),
                    v[:, :, start : start + n].index_select(0, index),
                )
                for k, v in block.layers
            ]
        first = parts[0][0].layers[0][0]
        device = first.device
        indices = [
            (torch.tensor(dst, device=device), torch.tensor(src, device=device))
            for _, dst, src, _, _ in parts
        ]
        shape = (len(picks), first.shape[1], width, first.shape[3])
        out = []
        for layer in range(len(parts[0][0].layers)):
            keys, values = first.new_zeros(shape), first.new_zeros(shape)
            for (block, _, _, start, n), (to, at) in zip(parts, indices, strict=True):
                k, v = block.layers[layer]
                keys[to, :, width - n :] = k[at, :, start : start + n]
                values[to, :, width - n :] = v[at, :, start : start + n]
            out.append((keys, values))
        return out

    def store(
        self,
        rows: Sequence[tuple[str | None, Tokens]],
        layers: list[KV],
        keys: Sequence[bytes] | None = None,
    ) -> None:
        """Keep the K/V of a forward pass whose row i was rows[i] = (adapter, tokens), right-aligned
        (keys[i]: the key of those tokens)."""
        block = KVBlock(layers)
        if block.nbytes > self.max_bytes - self.held_elsewhere:
            return
        for row, (adapter, tokens) in enumerate(rows):
            self._insert(adapter, tokens, block, row, row_key(tokens) if keys is None else keys[row])
        self._evict_to_budget()

    def hold_elsewhere(self, nbytes: int) -> None:
        """Count `nbytes` held outside the cache against its budget (evicting entries to make
        room), so that the cache and what shares its budget together hold at most `max_bytes`."""
        self.held_elsewhere = nbytes
        self._evict_to_budget()

    def _evict_to_budget(self) -> None:
        while self.nbytes + self.held_elsewhere > self.max_bytes and self._lru:
            self._remove(next(iter(self._lru)), prune=True)
            self.stats.evictions += 1

    def drop_adapter(self, adapter: str | None) -> None:
        """Forget every entry of `adapter` (it was unloaded, or reloaded with other weights)."""
        self._roots.pop(adapter, None)
        for entry in [e for e in self._lru if e.adapter == adapter]:
            self._remove(entry, prune=False)
        self._leaves.pop(adapter, None)

    def clear(self) -> None:
        for entry in list(self._lru):
            self._remove(entry, prune=False)
        self._roots.clear()
        self._leaves.clear()

    def _insert(self, adapter: str | None, tokens: Tokens, block: KVBlock, row: int, key: bytes) -> None:
        leaves = self._leaves.setdefault(adapter, {})
        node = leaves.get(key)
        if node is None:
            # Entries sit on leaves only, so on the path to the leaf of the tokens less their last
            # one there is no other entry: the walk starts there.
            parent = leaves.get(parent_key(key)) if len(tokens) else None
            node, rest = (parent, tokens[-1:]) if parent is not None else (self._roots.get(adapter), tokens)
            if node is None:
                node = self._roots[adapter] = _Node(None, -1)
            for token in _ints(rest):
                if node.entry is not None:  # a shorter entry on the path: the new one holds its tokens
                    self._remove(node.entry, prune=False)
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node(node, token)
                node = child
        if node.children:  # a longer cached entry already holds these tokens
            return
        if node.entry is not None:
            self._remove(node.entry, prune=False)
        entry = node.entry = Entry(adapter, block, row, block.width - len(tokens), node, key)
        leaves[key] = node
        self._lru[entry] = None
        if block.live == 0:
            self.nbytes += block.nbytes
        block.live += 1

    def _remove(self, entry: Entry, *, prune: bool) -> None:
        del self._lru[entry]
        del self._leaves[entry.adapter][entry.key]
        node = entry.leaf
        node.entry = None
        entry.block.live -= 1
        if entry.block.live == 0:
            self.nbytes -= entry.block.nbytes
        # A leaf without an entry would match tokens it cannot serve: cut it and its bare parents.
        while prune and node.parent is not None and not node.children and node.entry is None:
            del node.parent.children[node.token]
            node = node.parent


def _ints(tokens: Tokens) -> Sequence[int]:
    """Ids as Python ints, the trie's edges: int32 ids converted once, for a walk."""
    return tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
