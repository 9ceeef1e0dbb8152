"""The block manager: hands out the KV cache's blocks to sequences and takes them back.

The cache's layout and slot arithmetic are planning/kv_layout.py's (the planner sizes the same
pool); this module only keeps the free list.
"""
from __future__ import annotations

import collections

from ..planning.kv_layout import TRASH_BLOCK, CacheLayout
from .sequence import Sequence


class BlockManager:
    """Free list of cache blocks; a sequence holds `seq.block_table` and gives it back whole."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self.free: collections.deque[int] = collections.deque(
            b for b in range(layout.num_blocks) if b != TRASH_BLOCK)

    @property
    def num_usable(self) -> int:
        return self.layout.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self.free)

    def can_hold(self, seq: Sequence, tokens: int) -> bool:
        """Whether `seq` can grow to `tokens` positions with the free blocks."""
        return self.layout.blocks_for(tokens) - len(seq.block_table) <= len(self.free)

    def grow(self, seq: Sequence, tokens: int) -> None:
        """Give `seq` blocks for positions 0..tokens-1 (check `can_hold` first)."""
        need = self.layout.blocks_for(tokens) - len(seq.block_table)
        if need > len(self.free):
            raise RuntimeError(f"{need} blocks asked, {len(self.free)} free")
        for _ in range(need):
            seq.block_table.append(self.free.popleft())

    def release(self, seq: Sequence) -> None:
        """Take back all of `seq`'s blocks (none held: nothing to do)."""
        self.free.extend(seq.block_table)
        seq.block_table = []
