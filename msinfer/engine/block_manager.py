"""The block manager: hands out the KV cache's blocks to sequences, takes them back, and keeps
full blocks as a prefix cache.

The cache's layout and slot arithmetic are planning/kv_layout.py's (the planner sizes the same
pool); this module keeps the free blocks and, with prefix caching, what each full block holds.

Prefix caching (as vLLM's automatic prefix caching): a block whose every position has been
computed is named by a hash chained over its tokens and every token before it, so equal names
mean equal K/V. A new sequence takes the longest run of named blocks matching its tokens (never
its last token: that one is computed, so the sequence has logits; nor a position whose logits
score its prompt, when it asks for prompt logprobs, as vLLM) and is prefilled from there.
Blocks carry reference counts: a block several sequences hold is only ever read (a sequence
writes only past its matched blocks). A block nobody holds stays named and free; it is reused
for something else only when the pool runs out of unnamed free blocks, least recently freed
first. Every decision is a pure function of the calls made, so every rank of a tensor group
makes the same ones (and the schedule digest, which covers the block tables, checks it).
"""
from __future__ import annotations

import collections
import hashlib

from ..planning.kv_layout import TRASH_BLOCK, CacheLayout
from .sequence import Sequence


class BlockManager:
    """The pool of cache blocks; a sequence holds `seq.block_table` and gives it back whole."""

    def __init__(self, layout: CacheLayout, prefix_caching: bool = True) -> None:
        self.layout = layout
        self.prefix_caching = prefix_caching
        self.refs = [0] * layout.num_blocks
        # free blocks holding nothing reusable, then free named ones (least recently freed first)
        self.free: collections.deque[int] = collections.deque(
            b for b in range(layout.num_blocks) if b != TRASH_BLOCK)
        self.free_named: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.named: dict[bytes, int] = {}  # block name -> block
        self.name_of: dict[int, bytes] = {}  # block -> its name
        self.queried_tokens = 0  # prompt tokens looked up, and found, in the cache
        self.hit_tokens = 0
        # told of the prefix cache's changes, as vLLM's KV events say them (server/kv_events.py):
        # stored(names, parent name or None, tokens), removed(names), cleared()
        self.listener = None

    @property
    def num_usable(self) -> int:
        return self.layout.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.free_named)

    @property
    def num_used(self) -> int:
        """Blocks sequences hold (free named blocks are free: they can be taken any time)."""
        return self.num_usable - self.num_free

    # ---- admission --------------------------------------------------------------------------

    def match(self, seq: Sequence) -> list[int]:
        """The blocks of the cache that hold the longest prefix of `seq`'s tokens, never its
        last token (empty without prefix caching)."""
        if not self.prefix_caching:
            return []
        usable = seq.length - 1
        if seq.unscored_prompt:  # positions that score prompt tokens need their logits
            usable = min(usable, seq.unscored_prompt.start)
        names = self._names(seq, usable // self.layout.block_size)
        found = []
        for name in names:
            block = self.named.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def can_admit(self, seq: Sequence, matched: list[int]) -> bool:
        """Whether `seq` fits with `matched` (from `match`) and free blocks for the rest."""
        taken_free = sum(1 for b in matched if self.refs[b] == 0)
        need = self.layout.blocks_for(seq.length) - len(matched)
        return need <= self.num_free - taken_free

    def admit(self, seq: Sequence, matched: list[int]) -> None:
        """Give `seq` the `matched` blocks (check `can_admit` first) and free ones for the rest
        of its tokens; its first `len(matched)` blocks are computed already."""
        for block in matched:
            if self.refs[block] == 0:
                del self.free_named[block]
            self.refs[block] += 1
        seq.block_table = list(matched)
        seq.named_blocks = len(matched)
        cached = len(matched) * self.layout.block_size
        seq.computed = max(seq.computed, cached)  # a waiting sequence has computed nothing
        if self.prefix_caching:
            self.queried_tokens += seq.length
            self.hit_tokens += cached
        self.grow(seq, seq.length)

    # ---- growth and release -----------------------------------------------------------------

    def can_hold(self, seq: Sequence, tokens: int) -> bool:
        """Whether `seq` can grow to `tokens` positions with the free blocks."""
        return self.layout.blocks_for(tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, tokens: int) -> None:
        """Give `seq` blocks for positions 0..tokens-1 (check `can_hold` first)."""
        need = self.layout.blocks_for(tokens) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError(f"{need} blocks asked, {self.num_free} free")
        for _ in range(need):
            block = self._take_free()
            self.refs[block] = 1
            seq.block_table.append(block)

    def shrink(self, seq: Sequence, tokens: int) -> None:
        """Give back `seq`'s blocks past those positions 0..tokens-1 need: room taken for
        speculative proposals that were rejected (nothing past the computed positions is
        named, so they hold nothing reusable)."""
        keep = self.layout.blocks_for(tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.refs[block] -= 1
            self.free.appendleft(block)

    def _take_free(self) -> int:
        if self.free:
            return self.free.popleft()
        block, _ = self.free_named.popitem(last=False)  # evict the least recently freed
        name = self.name_of.pop(block)
        del self.named[name]
        if self.listener is not None:
            self.listener.removed([name])
        return block

    def release(self, seq: Sequence) -> None:
        """Take back all of `seq`'s blocks (none held: nothing to do). Named blocks stay in
        the cache; the last ones freed are the last evicted (a sequence's later blocks go
        before its first ones, which more sequences share)."""
        for block in reversed(seq.block_table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.name_of:
                    self.free_named[block] = None
                else:
                    self.free.append(block)
        seq.block_table = []
        seq.named_blocks = 0

    # ---- naming computed blocks ---------------------------------------------------------------

    def computed(self, seq: Sequence) -> None:
        """After a step: name `seq`'s blocks that are now computed in full."""
        if not self.prefix_caching:
            return
        full = min(seq.computed // self.layout.block_size, len(seq.block_table))
        if full <= seq.named_blocks:
            return
        names = self._names(seq, full)
        stored = []
        for index in range(seq.named_blocks, full):
            block, name = seq.block_table[index], names[index]
            # the same tokens computed twice (two sequences at once): the first one stays
            if name not in self.named and block not in self.name_of:
                self.named[name] = block
                self.name_of[block] = name
                stored.append(index)
        if stored and self.listener is not None:
            self._tell_stored(seq, names, stored)
        seq.named_blocks = full

    def _tell_stored(self, seq, names, stored):
        """One `stored` per run of consecutive blocks (each chained to the block before)."""
        size = self.layout.block_size
        runs = [[stored[0]]]
        for index in stored[1:]:
            if index == runs[-1][-1] + 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            self.listener.stored([names[i] for i in run], names[run[0] - 1] if run[0] else None,
                                 seq.token_slice(run[0] * size, (run[-1] + 1) * size))

    def reset_prefix_cache(self) -> bool:
        """Forget every named block (vLLM's reset_prefix_cache); only while no sequence holds
        a block (False, nothing done, otherwise)."""
        if self.num_used:
            return False
        self.free.extend(self.free_named)
        self.free_named.clear()
        self.named.clear()
        self.name_of.clear()
        if self.listener is not None:
            self.listener.cleared()
        return True

    def _names(self, seq: Sequence, count: int) -> list[bytes]:
        """The names of `seq`'s first `count` blocks (kept on the sequence: its tokens never
        change)."""
        if len(seq.block_names) < count:
            block_names(seq.token_slice(0, count * self.layout.block_size),
                        self.layout.block_size, count, seq.block_names,
                        salt=seq.params.cache_salt)
        return seq.block_names[:count]


def block_names(tokens, block_size, count, names=None, salt=None):
    """The names of the first `count` blocks of `tokens`, each a hash over the block's tokens
    and the name before it, the first over `salt` (a request's cache_salt) when given;
    extends `names` (the first ones, already known) in place."""
    names = [] if names is None else names
    first = b"" if salt is None else b"salt\0" + salt.encode("utf-8", "surrogatepass")
    while len(names) < count:
        i = len(names)
        h = hashlib.blake2b(names[-1] if names else first, digest_size=16)
        h.update(repr(list(tokens[i * block_size:(i + 1) * block_size])).encode())
        names.append(h.digest())
    return names
