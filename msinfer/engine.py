"""Compiled generation loop: prefill and decode graphs, shape buckets, static KV cache.

GRAPH_MODE compiles one graph per input shape. To keep that number small and fixed, every
call is padded to a bucket: the batch to a power of two (up to `max_batch`), the prompt length
to a prefill bucket, and the attended context of a decode step to a context bucket. Prompts of
different lengths in the same bucket reuse one compiled graph; `compilations` counts the
graphs MindSpore actually compiled (its own per-Cell compile cache).
"""
import dataclasses
import time

import numpy as np
from mindspore import Tensor

from . import log
from .errors import MsinferError
from .model import DecodeStep, PrefillStep

_MASKED = -1e30  # added to attention scores (float32) of positions a query must not see


def power_of_two_buckets(smallest, largest):
    """smallest, 2*smallest, ... capped by and always including `largest`."""
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    buckets.append(largest)
    return tuple(buckets)


def bucket_for(size, buckets):
    for bucket in buckets:
        if size <= bucket:
            return bucket
    raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass
class Sequence:
    """One request in flight: its prompt, what it generated so far, and why it stopped."""

    prompt: list
    max_tokens: int
    generated: list = dataclasses.field(default_factory=list)
    finish_reason: str = None


class Engine:
    def __init__(self, model, max_batch, max_len, prefill_buckets=None, context_buckets=None,
                 max_prefill_tokens=1024):
        self.model = model
        self.max_batch = max_batch
        self.max_len = max_len
        # A compiled graph keeps its activation memory (on CPU, for every layer at once), so
        # prefill runs at most this many (padded) tokens per call: several rows of short
        # prompts together, long prompts a row at a time.
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_heads = model.kv_heads
        self.batch_buckets = power_of_two_buckets(1, max_batch)
        self.prefill_buckets = prefill_buckets or power_of_two_buckets(min(16, max_len), max_len)
        self.context_buckets = context_buckets or power_of_two_buckets(min(64, max_len),
                                                                       max_len)
        self.prefill_step = PrefillStep(model)
        self.decode_step = DecodeStep(model)
        self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0,
                      "prefill_tokens": 0, "decode_tokens": 0}

    @property
    def compilations(self):
        """Graphs compiled so far (prefill and decode)."""
        return len(self.prefill_step.compile_cache) + len(self.decode_step.compile_cache)

    def check_fits(self, prompt_len, max_tokens):
        if prompt_len < 1:
            raise MsinferError("empty prompt: give at least one token")
        if prompt_len + max_tokens > self.max_len:
            raise MsinferError(
                f"prompt of {prompt_len} tokens + max_tokens {max_tokens} = "
                f"{prompt_len + max_tokens} exceeds the KV cache of {self.max_len} positions; "
                "raise max_len (--max-len) or lower max_tokens")

    def generate(self, sequences, next_tokens, is_finished):
        """Run `sequences` to completion, in batches of at most `max_batch`.

        next_tokens(rows, logits) -> token ids for those rows (sampling lives outside);
        is_finished(row, sequence) -> a finish reason or None, checked after each token.
        """
        for seq in sequences:
            self.check_fits(len(seq.prompt), seq.max_tokens)
        for start in range(0, len(sequences), self.max_batch):
            chunk = list(range(start, min(start + self.max_batch, len(sequences))))
            self._generate_batch([sequences[i] for i in chunk], chunk, next_tokens, is_finished)
        return sequences

    def _generate_batch(self, seqs, rows, next_tokens, is_finished):
        count = len(seqs)
        batch = bucket_for(count, self.batch_buckets)
        lengths = np.ones(batch, np.int64)
        lengths[:count] = [len(s.prompt) for s in seqs]
        start = time.perf_counter()
        logits = self.prefill(seqs, lengths, batch)
        self.stats["prefill_s"] += time.perf_counter() - start
        self.stats["prefill_tokens"] += int(lengths[:count].sum())
        positions = lengths.copy()  # where each row's next token goes
        last = np.zeros(batch, np.int64)
        live = list(range(count))
        steps = max(s.max_tokens for s in seqs)
        progress = log.Progress("generating", steps)
        for step in range(steps):
            tokens = next_tokens([rows[i] for i in live], logits[live])
            for i, token in zip(live, tokens):
                seqs[i].generated.append(int(token))
                last[i] = token
                reason = is_finished(rows[i], seqs[i])
                if reason is None and len(seqs[i].generated) >= seqs[i].max_tokens:
                    reason = "length"
                seqs[i].finish_reason = reason
            live = [i for i in live if seqs[i].finish_reason is None]
            progress.step(step + 1, f"{len(live)} of {count} running")
            if not live:
                break
            start = time.perf_counter()
            logits = self.decode(last, positions, batch)
            self.stats["decode_s"] += time.perf_counter() - start
            self.stats["decode_steps"] += 1
            self.stats["decode_tokens"] += len(live)
            positions[live] += 1  # finished and padding rows stay put, inside the cache

    def prefill(self, seqs, lengths, batch):
        seq_len = bucket_for(int(lengths.max()), self.prefill_buckets)
        ids = np.zeros((batch, seq_len), np.int32)
        for i, s in enumerate(seqs):
            ids[i, :len(s.prompt)] = s.prompt
        rows = max(b for b in self.batch_buckets
                   if b <= batch and (b == 1 or b * seq_len <= self.max_prefill_tokens))
        return np.concatenate([
            self.prefill_step(*self._prefill_inputs(ids[first:first + rows],
                                                    lengths[first:first + rows], first))
            .asnumpy() for first in range(0, batch, rows)])

    def _prefill_inputs(self, ids, lengths, first_row=0):
        """Inputs of one prefill call for cache rows first_row .. first_row + len(ids) - 1."""
        batch, seq_len = ids.shape
        last_index = np.stack([np.arange(batch), lengths - 1], axis=1).astype(np.int32)
        b, h, s = np.meshgrid(np.arange(first_row, first_row + batch), np.arange(self.kv_heads),
                              np.arange(seq_len), indexing="ij")
        cache_rows = self._cache_rows(b, h, s)
        causal = np.triu(np.full((seq_len, seq_len), _MASKED, np.float32), k=1)
        return Tensor(ids), Tensor(last_index), Tensor(cache_rows), Tensor(causal)

    def decode(self, tokens, positions, batch):
        return self.decode_step(*self._decode_inputs(tokens, positions, batch)).asnumpy()

    def _decode_inputs(self, tokens, positions, batch):
        context = bucket_for(int(positions.max()) + 1, self.context_buckets)
        b, h = np.meshgrid(np.arange(batch), np.arange(self.kv_heads), indexing="ij")
        cache_rows = self._cache_rows(b, h, positions[b])
        b, h, t = np.meshgrid(np.arange(batch), np.arange(self.kv_heads), np.arange(context),
                              indexing="ij")
        context_rows = self._cache_rows(b, h, t)
        visible = np.arange(context)[None, :] <= positions[:, None]
        mask = np.where(visible, 0.0, _MASKED).astype(np.float32)
        return (Tensor(tokens.astype(np.int32)), Tensor(positions.astype(np.int32)),
                Tensor(cache_rows), Tensor(context_rows), Tensor(mask))

    def _cache_rows(self, batch_row, kv_head, position):
        """Row of each (batch row, KV head, position) in the flattened caches (see model)."""
        rows = (batch_row * self.kv_heads + kv_head) * self.max_len + position
        return rows.reshape(-1).astype(np.int32)

    def compile_for_layouts(self):
        """Compile the smallest prefill and decode graphs without running them. Under
        semi_auto_parallel this fixes every parameter's layout (its local slice) before the
        weights are loaded."""
        ones = np.ones(1, np.int64)
        self.prefill_step.compile(*self._prefill_inputs(
            np.zeros((1, self.prefill_buckets[0]), np.int32), ones))
        self.decode_step.compile(*self._decode_inputs(np.zeros(1, np.int64), ones, 1))
