"""The shapes the engine's graphs are compiled for, and how many graphs that makes: every
call is padded to a bucket, so the set is fixed by the engine's settings (docs/engine.md,
'Compiled graphs'). The model runner pads its calls with these buckets; the planner counts
the graphs a configuration's warm-up compiles from the same ones."""
from __future__ import annotations

import dataclasses


def power_buckets(smallest, largest, factor=2):
    """smallest, smallest*factor, ... capped by and always including `largest`."""
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= factor
    buckets.append(largest)
    return tuple(buckets)


def round_up(size, step):
    return -(-size // step) * step


def bucket_for(size, buckets):
    for bucket in buckets:
        if size <= bucket:
            return bucket
    raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    batch: tuple  # sequences of a decode step
    context: tuple  # context slots a call reads
    chunk: tuple  # tokens of a prefill call
    rows: tuple  # lm_head rows (the batch buckets)

    @classmethod
    def for_engine(cls, max_num_seqs, max_prefill_tokens, max_len, step=1):
        """`step`: semi_auto splits the tokens of the dense layers over the data replicas
        (and MindSpore refuses a split that does not divide): every token and row count is a
        multiple of it."""
        batch = power_buckets(step, round_up(max_num_seqs, step))
        # Powers of 2, not 4: a 128-token prompt ran as a padded 256-token chunk at 0.58x the
        # speed (bench/README.md); the cost is two more chunk sizes to compile.
        chunk = power_buckets(round_up(min(16, max_prefill_tokens), step),
                              round_up(max_prefill_tokens, step))
        return cls(batch=batch, context=power_buckets(min(64, max_len), max_len), chunk=chunk,
                   rows=batch)

    def calls(self):
        """(kind, tokens or batch, context) of every call shape: each batch over each context;
        each chunk over each context that holds it."""
        return ([("decode", b, t) for b in self.batch for t in self.context]
                + [("prefill", c, t) for c in self.chunk for t in self.context if t >= c])

    def graphs(self, mode):
        """Graphs warm-up compiles: semi_auto one whole-model graph per call shape; explicit
        one layer-stack graph per call shape, an embedding graph per token count and an
        lm_head graph per row count (prefill picks its rows first, so its head is a decode
        step's: model_runner.py)."""
        shapes = len(self.calls())
        if mode == "semi_auto":
            return shapes
        return shapes + len(set(self.batch) | set(self.chunk)) + len(self.rows)
