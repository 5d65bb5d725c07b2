"""The engine's side of a paged target cache (docs/kv-cache.md "Paged cache"): admission by
free blocks, block tables kept in step with the engine's rows, preemption of the newest
request when blocks run out, prefix caching.

`Engine` owns one `Paging` where its runner's cache is paged (`LocalRunner.paged`). Rows are
the engine's compact cache slots (request i in row i); a request's blocks follow it when
`Engine._remove` moves the last row into a freed one (`KVCache.copy_slot` copies the table).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from eagle2.blocks import BlockManager


class PagedRunner(Protocol):
    paged: tuple[int, int] | None  # (num_blocks, block_size)

    def set_blocks(self, slot: int, blocks: list[int]) -> None: ...


class Paging:
    """Block tables of the engine's requests over the runner's paged cache.

    max_entries: the most entries one request may hold (max_context + tree_margin); the pool
    must hold one such request, so a request running alone never lacks blocks."""

    def __init__(self, runner: PagedRunner, max_entries: int, prefix_caching: bool = True):
        num_blocks, block_size = runner.paged
        self.runner = runner
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        if self.blocks.blocks_for(max_entries) > num_blocks:
            raise ValueError(
                f"the paged cache's {num_blocks} blocks of {block_size} entries hold less than "
                f"one request of {max_entries} entries; give more memory or a shorter context")
        self._shown: dict[str, int] = {}  # seq id -> table length the runner's row has

    def admit(self, seq_id: str, row: int, tokens: Sequence[int], use_cache: bool) -> int | None:
        """Blocks for a request about to be prefilled in `row` with these tokens (a prompt,
        or a preempted request's prompt and output). use_cache: take the longest cached
        prefix. -> how many leading tokens' K/V are cached, or None (nothing taken) where the
        blocks are not free."""
        caching = self.blocks.prefix_caching
        self.blocks.prefix_caching = caching and use_cache
        try:
            cached = self.blocks.allocate(seq_id, tokens, len(tokens))
        finally:
            self.blocks.prefix_caching = caching
        if cached is not None:
            self._show(seq_id, row)
        return cached

    def can_admit(self, tokens: Sequence[int], use_cache: bool, spare: int = 0) -> bool:
        """Whether `admit` would succeed and leave `spare` blocks free."""
        if not use_cache or not self.blocks.prefix_caching:
            return self.blocks.blocks_for(len(tokens)) + spare <= self.blocks.num_free
        return self.blocks.can_allocate(tokens, len(tokens), spare)

    def cached_prefix(self, tokens: Sequence[int], use_cache: bool) -> int:
        """How many leading tokens' K/V `admit` would find cached now."""
        return self.blocks.cached_prefix(tokens) if use_cache else 0

    def ensure(self, seq_id: str, row: int, num_entries: int) -> bool:
        """Room for num_entries entries (the committed ones and a tree); False: no blocks."""
        if not self.blocks.ensure(seq_id, num_entries):
            return False
        self._show(seq_id, row)
        return True

    def _show(self, seq_id: str, row: int) -> None:
        table = self.blocks.table(seq_id)
        if self._shown.get(seq_id) != len(table):
            self.runner.set_blocks(row, table)
            self._shown[seq_id] = len(table)

    def commit(self, seq_id: str, length: int, tokens: Callable) -> None:
        """The request's first `length` entries are committed: hash the blocks that filled
        (tokens(): its token ids, at least `length` of them where it has not finished)."""
        size = self.blocks.block_size
        table = self.blocks.tables[seq_id]
        if self.blocks.prefix_caching and length // size > len(table.hashes):
            known = tokens()
            self.blocks.commit(seq_id, known[: min(length, len(known))])

    def free(self, seq_id: str, row: int, last: int) -> None:
        """Release the request's blocks; row `last` (moved into `row`) reads no blocks."""
        self.blocks.free(seq_id)
        self._shown.pop(seq_id, None)
        self.runner.set_blocks(last, [])
