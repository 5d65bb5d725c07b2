"""Paged KV blocks: a free pool, a block table per sequence, prefix caching (docs/kv-cache.md
"Blocks").

The target's K/V live in fixed-size blocks of `block_size` entries. A sequence's entry t (its
t-th token's K/V, tree scratch included) is entry t % block_size of block
`table[t // block_size]`. This module does the bookkeeping only (which block holds what); the
tensors are `attention.KVCache`'s.

Prefix caching: a block whose `block_size` entries are all committed gets a content hash,
chained through the prefix (hash_i = H(hash_{i-1}, tokens of block i)), so equal hashes mean
equal token prefixes and, for one model, equal K/V. A hashed block stays findable while it is
referenced and, once free, in an LRU until its memory is taken for another block: a new
request whose prompt starts with the same full blocks takes them (reference counted) and
computes only the rest. E.g. block_size 4, prompt [1..10]: blocks 0 and 1 ([1..4], [5..8])
can be shared, the last two tokens are computed; with [1..8] only block 0 is taken, since the
last prompt token must be computed for its logits.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained content hash of one full block: 16 bytes of BLAKE2b over the parent's hash
    and the block's token ids (int64)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class PrefixStats:
    """Prefix-cache lookups: prompt tokens asked for and how many were found cached."""

    queries: int = 0  # prompts looked up
    query_tokens: int = 0  # their tokens
    hit_tokens: int = 0  # of those, the tokens whose K/V were taken from cached blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class BlockPool:
    """`num_blocks` blocks with reference counts; the free ones in an LRU (least recently
    freed first, taken first), hashed free ones findable by hash until taken."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id (referenced or free)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, count: int) -> list[int]:
        """count free blocks, referenced once; a hashed one is forgotten (evicted)."""
        assert count <= len(self.free), f"{count} blocks asked, {len(self.free)} free"
        out = []
        for _ in range(count):
            idx, _ = self.free.popitem(last=False)
            h = self.hash_of[idx]
            if h is not None:
                del self.cached[h]
                self.hash_of[idx] = None
            self.ref_counts[idx] = 1
            out.append(idx)
        return out

    def share(self, idx: int) -> None:
        """One more reference to a block (a prefix-cache hit); a free one leaves the LRU."""
        if self.ref_counts[idx] == 0:
            del self.free[idx]
        self.ref_counts[idx] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each; blocks that become free join the LRU, hashed ones at
        its end (kept longest; the last block of a sequence is freed first, so a prefix's tail
        is evicted before its head), unhashed ones at its front (reused first)."""
        for idx in reversed(blocks):
            self.ref_counts[idx] -= 1
            assert self.ref_counts[idx] >= 0, f"block {idx} released twice"
            if self.ref_counts[idx] == 0:
                self.free[idx] = None
                self.free.move_to_end(idx, last=self.hash_of[idx] is not None)

    def register(self, idx: int, h: bytes) -> None:
        """Block idx (full, committed) holds the prefix whose hash is h. Where another block
        already holds it, idx stays unhashed (the two are not merged)."""
        if h not in self.cached and self.hash_of[idx] is None:
            self.cached[h] = idx
            self.hash_of[idx] = h


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of its first len(hashes) full blocks


class BlockManager:
    """Block tables of running sequences over one `BlockPool`.

    E.g. block_size 4, 8 blocks: `allocate("a", prompt of 6, 6 + 3)` takes blocks [0, 1, 2]
    (entries 0-8: the prompt and a 3-node tree); `commit("a", 7 tokens)` hashes block 0;
    `free("a")` returns [0, 1, 2], block 0 findable by its hash until taken again.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.tables: dict[str, _Table] = {}
        self.stats = PrefixStats()

    def blocks_for(self, num_entries: int) -> int:
        return -(-num_entries // self.block_size)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def table(self, seq_id: str) -> list[int]:
        return self.tables[seq_id].blocks

    def _match(self, tokens: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks of tokens' longest cached full-block prefix, leaving at least
        the last token to compute, and their hashes (hashed block by block up to the first
        miss: a waiting prompt is looked up every step, and most of a long one is not cached;
        a 4,000-token prompt hashed whole cost ~0.2 ms a lookup)."""
        if not self.prefix_caching:
            return [], []
        found, hashes, parent, size = [], [], b"", self.block_size
        for i in range((len(tokens) - 1) // size):
            parent = block_hash(parent, tokens[i * size:(i + 1) * size])
            idx = self.pool.cached.get(parent)
            if idx is None:
                break
            found.append(idx)
            hashes.append(parent)
        return found, hashes

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens' K/V `allocate` would find cached now."""
        return len(self._match(tokens)[0]) * self.block_size

    def can_allocate(self, tokens: Sequence[int], num_entries: int, spare: int = 0) -> bool:
        """Whether `allocate(_, tokens, num_entries)` would succeed now and leave at least
        `spare` blocks free."""
        found, _ = self._match(tokens)
        from_free = sum(self.pool.ref_counts[i] == 0 for i in found)
        return self.blocks_for(num_entries) - len(found) + spare <= self.num_free - from_free

    def allocate(self, seq_id: str, tokens: Sequence[int], num_entries: int) -> int | None:
        """A table for a new sequence with prompt `tokens`, covering num_entries entries
        (>= len(tokens)), its leading blocks taken from the prefix cache.
        -> how many leading tokens' K/V are cached (a multiple of block_size), or None (and
        nothing taken) where too few blocks are free."""
        assert seq_id not in self.tables, f"{seq_id} already has blocks"
        assert num_entries >= len(tokens)
        if not self.can_allocate(tokens, num_entries):
            return None
        found, hashes = self._match(tokens)
        for idx in found:
            self.pool.share(idx)
        blocks = found + self.pool.take(self.blocks_for(num_entries) - len(found))
        self.tables[seq_id] = _Table(blocks, hashes)
        cached = len(found) * self.block_size
        self.stats.queries += 1
        self.stats.query_tokens += len(tokens)
        self.stats.hit_tokens += cached
        return cached

    def ensure(self, seq_id: str, num_entries: int) -> bool:
        """Grow the table to cover num_entries entries; False (nothing taken) where too few
        blocks are free (the caller preempts a sequence and tries again)."""
        table = self.tables[seq_id].blocks
        more = self.blocks_for(num_entries) - len(table)
        if more <= 0:
            return True
        if more > self.num_free:
            return False
        table.extend(self.pool.take(more))
        return True

    def commit(self, seq_id: str, tokens: Sequence[int]) -> None:
        """The sequence's first len(tokens) entries are committed and hold these tokens' K/V:
        hash its full blocks not hashed yet (they become shareable)."""
        if not self.prefix_caching:
            return
        t = self.tables[seq_id]
        size, full = self.block_size, len(tokens) // self.block_size
        parent = t.hashes[-1] if t.hashes else b""
        for i in range(len(t.hashes), full):
            parent = block_hash(parent, tokens[i * size:(i + 1) * size])
            t.hashes.append(parent)
            self.pool.register(t.blocks[i], parent)

    def free(self, seq_id: str) -> None:
        """Return the sequence's blocks (hashed ones stay findable until taken)."""
        self.pool.release(self.tables.pop(seq_id).blocks)
