"""The shapes the engine's calls are padded to, and the graphs they compile (docs/engine.md,
'Compiled graphs'). `ShapePlan` decides, for each batch the engine runs and for warm-up, one
`GraphShape`: the padded call and the graphs that run it; the model runner only executes
it. The planner counts the graphs a configuration's warm-up compiles with the same
functions (ShapeBuckets, ExplicitGraphs).

semi_auto compiles one whole-model graph per call shape (MindSpore lays out a graph for its
static shapes). Explicit mode compiles graphs of dynamic shape (`Cell.set_inputs` with None
for the context axis, and the rows of all but decode steps): one per `Graph`, which holds only
what a graph fixes when it is built (the kind of call, layers per graph, matmul forms, a
decode step's batch), so their number does not grow with max_model_len."""
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
    # speculative decoding: prefill calls from VERIFY_CHUNK tokens, which may ask the logits
    # of every row (a verification's)
    verify: bool = False

    # The smallest prefill chunk; with speculative decoding, VERIFY_CHUNK: a verification
    # (a sequence's last token and its 1 .. k proposals, the decodes of the step riding
    # beside it) is a call of a few rows, and padded to 16 it cost 1.6 decode steps where 2
    # static rows cost one and 8 about 1.35 (docs/speculative.md, "What a failed
    # verification costs").
    SMALLEST_CHUNK = 16
    VERIFY_CHUNK = 2

    @classmethod
    def for_engine(cls, limits, step=1, speculative=False):
        """The buckets of the engine's EngineLimits `limits`. `step`: semi_auto splits the
        tokens of the dense layers over the data replicas (and MindSpore refuses a split that
        does not divide): every token and row count is a multiple of it. `speculative`:
        chunks from VERIFY_CHUNK tokens up (speculative decoding's verifications)."""
        max_prefill_tokens, max_len = limits.max_prefill_tokens, limits.max_model_len
        batch = power_buckets(step, round_up(limits.max_num_seqs, step))
        smallest = cls.VERIFY_CHUNK if speculative else cls.SMALLEST_CHUNK
        # Powers of 2, not 4: a 128-token prompt padded to a 256-token chunk ran markedly
        # slower (docs/engine.md, "Measured figures behind the code"); the cost is two more
        # chunk sizes to compile.
        chunk = power_buckets(round_up(min(smallest, max_prefill_tokens), step),
                              round_up(max_prefill_tokens, step))
        return cls(batch=batch, context=power_buckets(min(64, max_len), max_len), chunk=chunk,
                   rows=batch, verify=speculative)

    def calls(self):
        """(kind, tokens or batch, context) of every call shape: each batch over each context;
        each chunk over each context that holds it."""
        return ([("decode", b, t) for b in self.batch for t in self.context]
                + [("prefill", c, t) for c in self.chunk for t in self.context if t >= c])


@dataclasses.dataclass(frozen=True)
class Graph:
    """One compiled graph of explicit mode: what it fixes when it is built. An axis it does
    not fix is dynamic (None in `Cell.set_inputs`): `rows` or `context` 0."""

    part: str  # "embedding", "layers" or "head"
    kind: str = None  # layers: "decode" (groups of one query) or "prefill" (one group)
    layers: int = 0  # layers: consecutive decoder layers
    weight_first: bool = False  # layers: the MLP's form; head: the lm_head's
    # (hardware.CpuMatmulForms: (W @ x.T).T instead of x @ W.T)
    rows: int = 0  # tokens (embedding, layers) or rows (head); 0: dynamic
    context: int = 0  # layers: context slots; 0: dynamic


class ExplicitGraphs:
    """Which graph of explicit mode runs each part of a call (EngineLimits.graph_shapes).

    static: one graph per shape, every axis fixed: a layer stack per call shape, an embedding
    per token count, an lm_head per row count (81 graphs for the 0.5B shape's defaults, 111
    at --max-len 32768).

    dynamic: one `Graph` per kind of call (a decode step's batch bucket, a full prefill
    chunk, a chunk of each bucket up to SHORT_CHUNK tokens, any other prefill chunk; the full
    chunk and the largest batch also over a short context where more layers fit there) and
    matmul form, so that their number does not grow with max_model_len (12 for the 0.5B
    shape on CPU). Every graph is dynamic in its context; the embedding, the lm_head and the chunks
    between SHORT_CHUNK tokens and the largest also in their rows. Decode steps, short chunks
    and full chunks keep their rows static: with every axis dynamic, MindSpore's CPU runtime
    re-infers and resizes each of a layer's ~100 kernels at every launch, at a cost that
    grows with the rows and weighs most on short calls (docs/engine.md, "Measured figures
    behind the code")."""

    # Chunks of up to this many tokens (a chat turn, a short prompt) run in graphs of static
    # rows, one per chunk bucket up to it.
    SHORT_CHUNK = 32

    def __init__(self, buckets, layers_for, forms=None, dynamic=False):
        """`layers_for(tokens, groups, context)`: layers per graph a call of that shape may
        run (planning/workspace.stack_layers); `forms`: the CPU matmul forms
        (hardware.CpuMatmulForms), None where the checkpoint's forms hold."""
        self.buckets = buckets
        self.layers_for = layers_for
        self.forms = forms
        self.dynamic = dynamic
        # The chunk buckets with graphs of static rows of their own: up to SHORT_CHUNK
        # tokens, short of the full chunk (which has its own); none for static graphs.
        self.short_chunks = (tuple(c for c in buckets.chunk[:-1] if c <= self.SHORT_CHUNK)
                             if dynamic else ())
        if dynamic:
            # One layers-per-graph for all the contexts (and prefill rows) a graph takes: the
            # fewest any of those calls may run (the workspace bounds long contexts), so one
            # graph serves them all instead of one per count.
            self.fewest = {("decode", b): min(layers_for(b, b, t) for t in buckets.context)
                           for b in buckets.batch}
            self.fewest["prefill"] = min(layers_for(c, 1, t) for c in buckets.chunk
                                         for t in buckets.context if t >= c)
            for rows in self.short_chunks:
                self.fewest[("prefill", rows)] = min(layers_for(rows, 1, t)
                                                     for t in buckets.context if t >= rows)
            # Where the workspace holds fewer layers of a long context (a profile that counts
            # every layer's activations: workspace.py), a full chunk, and the largest decode
            # batch if its short contexts fit at least twice the layers its long ones do, also
            # have a stack of the most layers they may run, for the contexts where that fits:
            # a long prompt's chunks ran slower in stacks of 2 layers where static graphs ran 6
            # (docs/engine.md, "Measured figures behind the code"). One decode batch only, to
            # keep the count small.
            full = buckets.chunk[-1]
            fits = [layers_for(full, 1, t) for t in buckets.context if t >= full]
            self.fewest["full"], self.most = min(fits), {"full": max(fits)}
            largest = buckets.batch[-1]
            most = max(layers_for(largest, largest, t) for t in buckets.context)
            if most >= 2 * self.fewest[("decode", largest)]:
                self.most[("decode", largest)] = most

    def mlp_weight_first(self, rows) -> bool:
        return self.forms is not None and self.forms.mlp_weight_first_for(rows)

    def head_weight_first(self, rows) -> bool:
        return self.forms is not None and self.forms.head_weight_first_for(rows)

    def layers(self, kind, size, context) -> Graph:
        """The layer stack of a call of `size` tokens (a decode step: its batch bucket) over
        `context` slots. A dynamic call's axes may be padded short of their bucket
        (ShapePlan.padded_context): its graph is its bucket's."""
        decode = kind == "decode"
        context = bucket_for(context, self.buckets.context)
        full_chunk = not decode and size == self.buckets.chunk[-1]
        if not decode:
            size = bucket_for(size, self.buckets.chunk)
        short = not decode and size in self.short_chunks
        groups = size if decode else 1
        static = not self.dynamic
        if static:
            layers = self.layers_for(size, groups, context)
        else:
            key = (kind, size) if decode or short else "full" if full_chunk else kind
            layers, most = self.fewest[key], self.most.get(key)
            if most is not None and self.layers_for(size, groups, context) >= most:
                layers = most
        return Graph("layers", kind, layers, self.mlp_weight_first(size),
                     rows=size if decode or short or full_chunk or static else 0,
                     context=context if static else 0)

    def embedding(self, tokens) -> Graph:
        return Graph("embedding", rows=0 if self.dynamic else tokens)

    def head(self, rows) -> Graph:
        return Graph("head", weight_first=self.head_weight_first(rows),
                     rows=0 if self.dynamic else rows)

    def all(self) -> dict:
        """{Graph: a call (kind, size, context) that runs it}: the embeddings, every call's
        layer stack, and the lm_heads over every row bucket (prefill picks its rows first,
        so its head is a decode step's: model_runner.py). A dynamic layer stack's call is at
        the smallest context a call of its size has, whatever context picked it. Warm-up
        runs those calls, which compiles every graph once."""
        graphs = {}
        for kind, size, context in self.buckets.calls():
            at = context
            if self.dynamic:
                at = min(t for t in self.buckets.context if kind == "decode" or t >= size)
            graphs.setdefault(self.embedding(size), (kind, size, at))
            graphs.setdefault(self.layers(kind, size, context), (kind, size, at))
        for rows in self.buckets.rows:
            graphs.setdefault(self.head(rows), ("decode", rows, self.buckets.context[0]))
        if self.dynamic:
            # A prefill call needing more rows than the largest batch (a verification's
            # every position, prompt logprobs) takes a head of its chunk's rows, whose form
            # (weight_first) no decode batch may pick: warm-up runs such a chunk too.
            for size in self.buckets.chunk:
                if size > self.buckets.rows[-1]:
                    at = min(t for t in self.buckets.context if t >= size)
                    graphs.setdefault(self.head(size), ("prefill", size, at))
        return graphs


@dataclasses.dataclass(frozen=True)
class GraphShape:
    """One call as the model runner runs it: a "decode" step of `size` sequences (its batch
    bucket) or a "prefill" call of `size` tokens, over `context` slots, with the lm_head on
    `rows` rows (0: no lm_head). Explicit mode's graphs: `stack` the layer stack, `embedding`
    and `head` (None in semi_auto: one whole-model graph per (kind, size, context, rows))."""

    kind: str
    size: int
    context: int
    rows: int = 0
    stack: Graph | None = None
    embedding: Graph | None = None
    head: Graph | None = None


class ShapePlan:
    """The one place that decides a call's GraphShape: how far its tokens, context and lm_head
    rows are padded, and (explicit mode) which graphs run it. `graphs`: explicit mode's
    ExplicitGraphs; None: semi_auto."""

    # Axes a graph takes whatever their size (ExplicitGraphs, dynamic) are not padded to their
    # bucket: a decode step over 1,100 tokens of context reads 1,152 slots (a multiple of
    # CONTEXT_STEP), not 2,048; a prefill chunk between the short chunks' graphs and the
    # full chunk's runs its own tokens, as rows cost their compute (docs/engine.md,
    # "Compiled graphs"), except one within FULL_CHUNK_REACH tokens of a full chunk, which
    # takes the full chunk's graph of static rows (faster than dynamic rows by more); a short
    # chunk takes its bucket's static rows.
    CONTEXT_STEP = 64
    FULL_CHUNK_REACH = 16

    def __init__(self, buckets: ShapeBuckets, graphs: ExplicitGraphs | None = None):
        self.buckets = buckets
        self.graphs = graphs
        self.dynamic = graphs is not None and graphs.dynamic

    def decode(self, count, longest) -> GraphShape:
        """A decode step of `count` sequences, the longest `longest` tokens."""
        batch = bucket_for(count, self.buckets.batch)
        return self.at("decode", batch, self.padded_context(longest))

    def prefill(self, tokens, context, rows) -> GraphShape:
        """A prefill call of `tokens` tokens over `context` slots that needs `rows` logits rows
        (0: none, and explicit mode skips the lm_head; semi_auto's graph always has one)."""
        size = self.padded_chunk(tokens)
        padded = self.padded_context(context)
        if rows == 0 and self.graphs is not None:
            return self._shape("prefill", size, padded, 0)
        return self._shape("prefill", size, padded, self.prefill_rows(rows, size))

    def at(self, kind, size, context) -> GraphShape:
        """The call of a padded (kind, size, context) with its fewest lm_head rows (a decode
        step: its batch), or with verifications (ShapeBuckets.verify) a prefill call's most
        (every row: the lm_head a verification's rows take beyond the largest batch, compiled
        by warm-up): what warm-up runs."""
        rows = (size if kind == "decode" else
                self.prefill_rows(size if self.buckets.verify else 1, size))
        return self._shape(kind, size, context, rows)

    def warmup(self) -> list:
        """Every GraphShape warm-up runs, so that serving compiles nothing. semi_auto: one
        per call shape (ShapeBuckets.calls). Explicit mode: one for each layer stack
        (ExplicitGraphs.all), at the smallest context a call of that size has (a graph first
        picked at a long context, for its fewer layers per graph, compiles as fast at a short
        one); their decode steps run the lm_heads of the batches and all run the embedding;
        a head only a chunk's rows pick gets a call of that chunk with a row per token."""
        if self.graphs is None:
            return [self.at(kind, size, context) for kind, size, context in self.buckets.calls()]
        graphs = self.graphs.all()
        shapes = [dataclasses.replace(self.at(kind, size, context), stack=graph)
                  for graph, (kind, size, context) in graphs.items() if graph.part == "layers"]
        run = {shape.head for shape in shapes}
        return shapes + [self._shape(kind, size, context, size)  # a head only a chunk picks
                         for graph, (kind, size, context) in graphs.items()
                         if graph.part == "head" and graph not in run]

    def _shape(self, kind, size, context, rows) -> GraphShape:
        graphs = self.graphs
        if graphs is None:
            return GraphShape(kind, size, context, rows)
        return GraphShape(kind, size, context, rows, stack=graphs.layers(kind, size, context),
                          embedding=graphs.embedding(size),
                          head=graphs.head(rows) if rows else None)

    def padded_context(self, length):
        """The context slots a call over `length` reads: its bucket (a graph per shape), or
        with dynamic graphs a multiple of CONTEXT_STEP within it."""
        bucket = bucket_for(length, self.buckets.context)
        return min(round_up(length, self.CONTEXT_STEP), bucket) if self.dynamic else bucket

    def padded_chunk(self, tokens):
        """The tokens a prefill call of `tokens` runs: its bucket; with dynamic graphs the
        full chunk near it, a short chunk's bucket, else its own tokens."""
        chunks = self.buckets.chunk
        if not self.dynamic:
            return bucket_for(tokens, chunks)
        if tokens > chunks[-1] - self.FULL_CHUNK_REACH:
            return chunks[-1]
        short = self.graphs.short_chunks
        return bucket_for(tokens, short) if short and tokens <= short[-1] else tokens

    def prefill_rows(self, count, size):
        """The lm_head rows a prefill call of `size` tokens computes when it needs `count`
        logits rows (one per chunk completing its prompt, more with prompt logprobs).

        Explicit mode: the row bucket of `count`. It picks those rows before its head graph
        (model_runner.ExplicitRunner._run), which is then the decode step's graph of that
        batch: no graph of its own for any (chunk, rows). More rows than the largest batch
        (prompt logprobs) take a row per token: a head graph of `size` rows, compiled when
        first asked, never by warm-up (few requests ask). One call reads the lm_head's weight
        once; the largest batch's head in turn read it once per batch (151,936 x 896 float32
        is 545 MB).

        semi_auto: the most rows a call of `size` tokens can need (one per completing chunk:
        at most min(max_num_seqs, size)), whatever `count`: the whole-model graph includes the
        lm_head, and one row count per chunk bucket keeps one graph per (chunk, context). The
        rows beyond `count` are row 0 again, computed and dropped. A call that needs more
        (prompt logprobs) has a row for every token: one more graph for that (chunk,
        context), compiled when first asked (warm-up does not: few requests ask)."""
        rows = self.buckets.rows
        if self.graphs is None:
            largest = bucket_for(min(size, rows[-1]), rows)
            return size if count > largest else largest
        if count > rows[-1]:
            return size
        return bucket_for(max(count, 1), rows)
