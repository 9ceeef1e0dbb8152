"""The paged KV cache: its layout, its size, and the block manager that hands out its blocks.

Layout. A K and a V tensor per decoder layer, each (num_slots, kv_heads, head_dim). A slot is
one token position of one sequence; slots come in blocks of `block_size` consecutive slots,
and a sequence's block table lists the blocks holding its positions in order, so position p
of a sequence lives in slot `table[p // block_size] * block_size + p % block_size`, in every
layer. Slots are on axis 0 because MindSpore's ScatterUpdate writes rows of axis 0 in place
(and cannot split that axis); the KV heads have their own axis, which a tensor-parallel plan
splits (each rank holds its local heads), as in vLLM's blocks x block_size x kv_heads x
head_dim. One tensor per layer, not one for all layers: a graph that runs several layers
updates each of its caches once (MindSpore copies a whole tensor that one graph updates
more than once: a decode graph over one shared cache ran several times slower, measured:
docs/engine.md, "Measured figures behind the code").

Explicit mode holds the same bytes as rows of one head's vector, (num_slots x kv_heads,
head_dim), row `slot * kv_heads + head` (`rows_shape`): a call writes its tokens' K/V at
`head_rows` and gathers its context at `rows_by_head`, which is already the by-head order
attention takes. Two things on MindSpore's CPU backend decide this: a Transpose of the
gathered context keeps an int64 index per element for as long as its graph lives (tens of MB
per layer for a large decode step), and reshaping a cache that the same graph updates copies
the whole cache at every read (docs/engine.md, "Measured figures behind the code").
semi_auto keeps (num_slots, kv_heads, head_dim):
MindSpore splits its head axis over the tensor ranks.

Block 0 is never handed out: padded tokens of a compiled call write there, and padded context
positions read from there (their attention weight is masked to zero).

This module owns all of that arithmetic; the planner, the block manager and the model runner
call it. Pure arithmetic: no MindSpore.
"""
import dataclasses

import numpy as np

from ..engine_config import DEFAULT_BLOCK_SIZE  # noqa: F401 (named here too)
from ..errors import MsinferError

TRASH_BLOCK = 0


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Shape and bytes of one rank's KV cache."""

    num_layers: int
    kv_heads: int  # held by this rank
    head_dim: int
    block_size: int
    num_blocks: int  # including the trash block
    dtype_bytes: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def shape(self) -> tuple:
        """Shape of one layer's K tensor (and of its V tensor)."""
        return (self.num_slots, self.kv_heads, self.head_dim)

    @property
    def rows_shape(self) -> tuple:
        """The same tensor as rows of one head's vector: explicit mode's layout."""
        return (self.num_slots * self.kv_heads, self.head_dim)

    @property
    def usable_tokens(self) -> int:
        """Token positions sequences can hold (the trash block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def total_bytes(self) -> int:
        return 2 * self.num_layers * self.num_slots * self.kv_heads * self.head_dim * self.dtype_bytes

    @staticmethod
    def bytes_per_block(num_layers, kv_heads, head_dim, block_size, dtype_bytes) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * dtype_bytes

    @classmethod
    def from_budget(cls, budget_bytes, num_layers, kv_heads, head_dim, block_size, dtype_bytes,
                    max_blocks=None):
        """As many blocks as `budget_bytes` holds (at most `max_blocks` usable ones); a budget
        without room for one usable block besides the trash block is an error."""
        per_block = cls.bytes_per_block(num_layers, kv_heads, head_dim, block_size, dtype_bytes)
        blocks = int(budget_bytes // per_block)
        if blocks < 2:
            raise MsinferError(
                f"KV cache budget {budget_bytes} bytes holds {blocks} block(s) of "
                f"{per_block} bytes ({block_size} tokens x {num_layers} layers x K and V x "
                f"{kv_heads} KV heads x {head_dim} x {dtype_bytes} bytes); it needs at least 2 "
                f"(one is reserved): raise kv_cache_memory to at least {2 * per_block}")
        if max_blocks is not None:
            blocks = min(blocks, max_blocks + 1)
        return cls(num_layers, kv_heads, head_dim, block_size, blocks, dtype_bytes)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def slots(self, block_table, positions) -> np.ndarray:
        """Slot of each position (an int array) of a sequence with this block table."""
        table = np.asarray(block_table, np.int64)
        positions = np.asarray(positions, np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def head_rows(self, slots) -> np.ndarray:
        """Rows (of `rows_shape`) of each slot's heads, slot by slot: where a call's tokens
        write their K/V, (tokens, kv_heads) flattened."""
        slots = np.asarray(slots, np.int64).reshape(-1, 1)
        return (slots * self.kv_heads + np.arange(self.kv_heads, dtype=np.int64)).reshape(-1)

    def rows_by_head(self, slots, groups) -> np.ndarray:
        """Rows (of `rows_shape`) that read `slots` (groups x T of them, group-major) head by
        head: (groups, kv_heads, T) flattened, so one Gather gives the context laid out by
        head."""
        slots = np.asarray(slots, np.int64).reshape(groups, 1, -1)
        heads = np.arange(self.kv_heads, dtype=np.int64).reshape(1, -1, 1)
        return (slots * self.kv_heads + heads).reshape(-1)
