"""The model runner: builds the model on this rank, loads its weight slices, owns the KV
cache, and turns one step's scheduled sequences into the tensors the compiled graphs take,
runs them and returns logits. Two runners behind one interface (`decode`, `prefill`,
`shapes`, `compile_shape`, `compilations`): `ExplicitRunner` and `SemiAutoRunner`;
`build_runner` makes the one a parallel mode needs.

Every call is padded to a shape bucket (planning/shapes.py):
- decode: batch B (powers of two up to max_num_seqs) x context T (powers of two from 64 up to
  max_model_len): B sequences, one token each, each over its own T gathered cache slots;
- prefill: chunk C tokens (16, 32, 64, ... up to max_prefill_tokens) x context T: the chunk's
  tokens (of one or several sequences) over their concatenated contexts, and the lm_head on
  R rows (the last token of each sequence whose prompt the chunk completes; powers of two).
In explicit mode a call is one embedding call, the decoder layers in stacks of k consecutive
layers (each layer's weights and KV cache passed in; k the fewest for a pass in a few calls,
within the planner's workspace for that shape: planning/workspace.py), and one lm_head call
(none for a prefill call that completes no prompt). Those graphs are of dynamic shape, so
their number does not grow with max_len (planning/shapes.ExplicitGraphs: dynamic in the
context, and in the rows of the prefill chunks between the short and the full ones), and a
call pads its context only to a multiple of 64 slots and such a chunk not at all (one within
16 tokens of a full chunk takes the full chunk's graph, a short one its bucket's). semi_auto
runs one whole-model graph per call shape.
"""
from __future__ import annotations

import dataclasses
import time

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from .. import log
from ..hardware import DTYPE_BYTES
from ..layers.attention import new_cache
from ..layers.cpu_forms import matmul_forms
from ..layers.parallel_context import ParallelContext
from ..layers.rotary import rotary_tables
from ..models.families import family_of
from ..models.loader import full_shapes, rank_weights
from ..models.quant_loader import quantized_rank_weights
from ..planning.kv_layout import TRASH_BLOCK, CacheLayout
from ..planning.shapes import ExplicitGraphs, Graph, ShapeBuckets, bucket_for, round_up
from ..planning.workspace import stack_layers

MASKED = -1e30  # added to the float32 scores of context positions a query must not see


class ModelRunner:
    """What both runners share: shape buckets, a step's inputs built from the block tables,
    timings, compiling ahead. A subclass runs the padded call (`_run`) and names its graphs."""

    # Whether every call computes logits rows (a whole-model graph always has its lm_head).
    needs_rows = False

    def __init__(self, ctx: ParallelContext, layout: CacheLayout, max_num_seqs: int,
                 max_prefill_tokens: int, max_model_len: int):
        config = ctx.config
        self.ctx = ctx
        self.layout = layout
        self.dtype = ctx.dtype
        self.num_layers = config.num_layers
        self.family = family_of(config)  # models/qwen2.py, qwen3.py: the model's Cells
        cos, sin = rotary_tables(config.head_dim, config.rope_theta, max_model_len,
                                 config.rope_scaling)
        host = np.float16 if str(ctx.dtype) == "Float16" else np.float32
        self.cos, self.sin = cos.astype(host), sin.astype(host)
        self.buckets = ShapeBuckets.for_engine(
            max_num_seqs, max_prefill_tokens, max_model_len,
            step=ctx.plan.data if ctx.mode == "semi_auto" else 1)
        self.batch_buckets = self.buckets.batch
        self.context_buckets = self.buckets.context
        self.chunk_buckets = self.buckets.chunk
        self.row_buckets = self.buckets.rows
        # Block 0 (TRASH_BLOCK) is never handed out. Padded tokens write their K/V to its first
        # slot, whatever they compute (inf or NaN where activations overflow); padded context
        # positions read its second slot, which nothing writes: zeros, whose masked score is
        # exp(-1e30) = 0 and whose value is 0, so 0 x 0 reaches the real rows, never 0 x inf.
        if layout.block_size < 2:
            raise ValueError(f"block_size {layout.block_size}: the runner needs at least 2 "
                             f"(block {TRASH_BLOCK}'s write slot and zero slot)")
        self.write_slot = TRASH_BLOCK * layout.block_size
        self.zero_slot = self.write_slot + 1
        # Wall time inside the graphs (inputs built, logits back on the host), by kind.
        self.timings = {"prefill_s": 0.0, "prefill_calls": 0, "prefill_tokens": 0,
                        "decode_s": 0.0, "decode_steps": 0, "decode_tokens": 0}

    @property
    def graphs(self) -> list:
        raise NotImplementedError

    @property
    def compilations(self) -> int:
        """Graphs compiled so far."""
        return sum(len(g.compile_cache) for g in self.graphs)

    @property
    def graph_count(self) -> int:
        """Graphs warm-up leaves compiled: one per call shape (semi_auto's whole model)."""
        return len(self.shapes())

    # ---- one step's inputs ----

    def decode(self, seqs) -> np.ndarray:
        """Logits (len(seqs), vocab) of the next token of each sequence (one pending token
        each: the last, at position length - 1)."""
        count = len(seqs)
        batch = bucket_for(count, self.batch_buckets)
        context = self.padded_context(max(s.length for s in seqs))
        ids = np.zeros(batch, np.int32)
        positions = np.zeros(batch, np.int64)
        write = np.full(batch, self.write_slot, np.int64)
        slots = np.full((batch, context), self.zero_slot, np.int64)
        mask = np.full((batch, 1, context), MASKED, np.float32)
        for i, seq in enumerate(seqs):
            n = seq.length
            ids[i] = seq.tokens[-1]
            positions[i] = n - 1
            row_slots = self.layout.slots(seq.block_table, np.arange(n))
            write[i] = row_slots[-1]
            slots[i, :n] = row_slots
            mask[i, 0, :n] = 0.0
        rows = np.arange(batch, dtype=np.int32)
        start, compiled = time.perf_counter(), self.compilations
        logits = self._run(ids, positions, write, slots.reshape(-1), mask, rows)[:count]
        self._time("decode", start, count, compiled, f"batch {batch} x context {context}")
        return logits

    def prefill(self, chunks) -> np.ndarray:
        """Runs the chunks (each writes its tokens' K/V); returns the logits rows of every
        chunk's `logit_positions()`, in chunk order: one row for each chunk that completes its
        sequence's pending tokens, and with prompt logprobs a row for each position scoring a
        prompt token before it (none at all: an empty array, and explicit mode skips the
        lm_head)."""
        total = sum(c.count for c in chunks)
        size = self.padded_chunk(total)
        context = self.padded_context(sum(c.start + c.count for c in chunks))
        ids = np.zeros(size, np.int32)
        positions = np.zeros(size, np.int64)
        write = np.full(size, self.write_slot, np.int64)
        owner = np.full(size, -1, np.int64)  # which chunk each token belongs to
        slots = np.full(context, self.zero_slot, np.int64)
        context_owner = np.full(context, -2, np.int64)
        context_position = np.zeros(context, np.int64)
        rows = []
        token, filled = 0, 0
        for i, c in enumerate(chunks):
            end = c.start + c.count
            span = np.arange(c.start, end)
            seq_slots = self.layout.slots(c.seq.block_table, np.arange(end))
            ids[token:token + c.count] = c.seq.tokens[c.start:end]
            positions[token:token + c.count] = span
            write[token:token + c.count] = seq_slots[c.start:]
            owner[token:token + c.count] = i
            slots[filled:filled + end] = seq_slots
            context_owner[filled:filled + end] = i
            context_position[filled:filled + end] = np.arange(end)
            rows += [token + position - c.start for position in c.logit_positions()]
            token += c.count
            filled += end
        visible = ((owner[:, None] == context_owner[None, :])
                   & (context_position[None, :] <= positions[:, None]))
        mask = np.where(visible, 0.0, MASKED).astype(np.float32)[None]
        padded_rows = None  # no chunk completes its prompt: no logits are needed
        if rows or self.needs_rows:
            padded_rows = np.zeros(self.prefill_rows(len(rows), size), np.int32)
            padded_rows[:len(rows)] = rows
        start, compiled = time.perf_counter(), self.compilations
        logits = self._run(ids, positions, write, slots, mask, padded_rows)
        logits = logits[:len(rows)] if logits is not None else np.zeros((0, 0), np.float32)
        self._time("prefill", start, total, compiled, f"chunk {size} x context {context}")
        return logits

    def padded_context(self, length):
        """The context slots a call over `length` reads: its bucket (a graph per shape)."""
        return bucket_for(length, self.context_buckets)

    def padded_chunk(self, tokens):
        """The tokens a prefill call of `tokens` runs: its bucket."""
        return bucket_for(tokens, self.chunk_buckets)

    def prefill_rows(self, count, size):
        """The lm_head rows a prefill call of `size` tokens computes when it needs `count`
        logits rows (one per chunk completing its prompt, more with prompt logprobs): the row
        bucket of `count`. Explicit mode picks those rows before its head graph
        (ExplicitRunner._run), which is then the decode step's graph of that batch: no graph
        of its own for any (chunk, rows). More rows than the largest batch (prompt logprobs)
        take a row per token: a head graph of `size` rows, compiled when first asked, never
        by warm-up (few requests ask). One call reads the lm_head's weight once; the largest
        batch's head in turn read it once per batch (151,936 x 896 float32 is 545 MB)."""
        if count > self.row_buckets[-1]:
            return size
        return bucket_for(max(count, 1), self.row_buckets)

    def _time(self, kind, start, tokens, compiled_before, shape):
        t = self.timings
        seconds = time.perf_counter() - start
        if self.compilations > compiled_before:  # a first call of this shape: say why it was slow
            log.get().info("compiled %s graphs for %s in %.1fs (%d graphs so far)", kind, shape,
                           seconds, self.compilations)
        t[f"{kind}_s"] += seconds
        t["prefill_calls" if kind == "prefill" else "decode_steps"] += 1
        t[f"{kind}_tokens"] += tokens

    def _rotary(self, positions):
        return (Tensor(self.cos[positions][:, None, :]),
                Tensor(self.sin[positions][:, None, :]))

    def _run(self, ids, positions, write, context_slots, mask, rows, graph=None):
        """mask (G, Q, T): G groups of Q queries, each over its own T context slots. Returns
        the logits of `rows`; None when rows is None (the lm_head is skipped). `graph`: the
        layer stack explicit mode runs instead of the one the shape picks (warm-up's)."""
        raise NotImplementedError

    # ---- compile ahead ----

    def shapes(self) -> list:
        """Every (kind, tokens-or-batch, context, lm_head rows) this runner's calls can have:
        what warm-up compiles, so that serving compiles nothing.

        decode: every batch bucket B over every context bucket T, the lm_head on B rows.
        prefill: every chunk bucket C over every context bucket T >= C (a chunk's context
        holds at least its own tokens, and the smallest bucket holding them is never below
        C's), and 1 to min(max_num_seqs, C) chunks completing their prompts, one lm_head row
        each. Those row counts need no shapes of their own: explicit mode's head graph after
        the rows are picked is the decode step's of that batch (prefill_rows), and semi_auto
        pads every prefill call of C tokens to the most rows C can complete (its
        prefill_rows), so each (C, T) is one whole-model graph."""
        return [(kind, size, context, size if kind == "decode" else self.prefill_rows(1, size))
                for kind, size, context in self.buckets.calls()]

    def compile_shape(self, kind: str, size: int, context: int, rows: int = 1,
                      graph=None) -> None:
        """Runs one padded call of that shape, with the lm_head on `rows` rows (a decode step:
        its batch), that writes only the trash block's write slot and reads its zero slot.
        `graph`: explicit mode's layer stack to run it with (runner.shapes())."""
        tokens = size
        mask = np.zeros((size, 1, context) if kind == "decode" else (1, size, context),
                        np.float32)
        slots = np.full(size * context if kind == "decode" else context, self.zero_slot,
                        np.int64)
        rows = np.zeros(size if kind == "decode" else self.prefill_rows(rows, size), np.int32)
        self._run(np.zeros(tokens, np.int32), np.zeros(tokens, np.int64),
                  np.full(tokens, self.write_slot, np.int64), slots, mask, rows, graph)


class ExplicitRunner(ModelRunner):
    """Explicit mode: this rank's weight slices and KV caches as Tensors passed to the graphs;
    a call is an embedding graph, the layers in LayerStacks of k consecutive layers, and an
    lm_head graph. Each of those is a graph of dynamic shape (planning/shapes.py `Graph`),
    built and compiled when a call first needs it; warm-up runs one call for each."""

    def __init__(self, ctx, layout, max_num_seqs, max_prefill_tokens, max_model_len, weights,
                 min_layers_per_graph=1, layer_peak_growth=1.0, dynamic=False):
        """weights: {name: Tensor} of this rank's slices, in the layouts the graphs take
        (the family's weight_layout). `min_layers_per_graph`, `layer_peak_growth`: the
        hardware profile's.
        `dynamic`: graphs of dynamic shape (EngineLimits.graph_shapes), else one per call
        shape."""
        super().__init__(ctx, layout, max_num_seqs, max_prefill_tokens, max_model_len)
        config = ctx.config
        family = self.family
        self.caches = [(new_cache(layout.rows_shape, ctx.dtype),
                        new_cache(layout.rows_shape, ctx.dtype))
                       for _ in range(config.num_layers)]
        self.embed_weight = weights[family.EMBEDDING_WEIGHT]
        self.layer_weights = [[weights[n] for n in family.layer_weight_names(i)]
                              for i in range(config.num_layers)]
        self.head_weights = [weights[n] for n in family.head_weight_names(config)]
        # Each layer's arguments of a LayerStack: its K and V caches, then its weights.
        self.layer_args = [t for (k, v), w in zip(self.caches, self.layer_weights)
                           for t in (k, v, *flat(w))]
        self.args_per_layer = len(self.layer_args) // config.num_layers
        # What the planner reserves for activations: each graph stays within it.
        self.layers_per_call = stack_layers(ctx.plan, DTYPE_BYTES[str(ctx.dtype).lower()],
                                            max_model_len, max_prefill_tokens, max_num_seqs,
                                            min_layers_per_graph, layer_peak_growth)
        self.graph_of = ExplicitGraphs(self.buckets, self.layers_per_call, matmul_forms(ctx),
                                       dynamic)
        self.cells = {}  # Graph -> its Cell, built when a call first needs it

    @property
    def graphs(self):
        return list(self.cells.values())

    @property
    def cache_bytes(self) -> int:
        """Bytes of this rank's KV cache tensors."""
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    @property
    def graph_count(self) -> int:
        return len(self.graph_of.all())

    # Axes a graph takes whatever their size (ExplicitGraphs) are not padded to their bucket:
    # a decode step over 1,100 tokens of context reads 1,152 slots (a multiple of
    # CONTEXT_STEP), not 2,048; a prefill chunk between the short chunks' graphs and the
    # full chunk's runs its own tokens, as rows cost their compute (in dynamic rows, a
    # 20-token prompt ran 1.12x as fast as 20 rows as padded to 32, bench/README.md),
    # except one within FULL_CHUNK_REACH tokens of a full chunk, which takes the full chunk's
    # graph of static rows (faster than dynamic rows by more); a short chunk takes its
    # bucket's static rows.
    CONTEXT_STEP = 64
    FULL_CHUNK_REACH = 16

    def padded_context(self, length):
        bucket = super().padded_context(length)
        return (min(round_up(length, self.CONTEXT_STEP), bucket) if self.graph_of.dynamic
                else bucket)

    def padded_chunk(self, tokens):
        if not self.graph_of.dynamic:
            return super().padded_chunk(tokens)
        full = self.chunk_buckets[-1]
        if tokens > full - self.FULL_CHUNK_REACH:
            return full
        short = self.graph_of.short_chunks
        return bucket_for(tokens, short) if short and tokens <= short[-1] else tokens

    def shapes(self):
        """One call for each layer stack (planning/shapes.py: ExplicitGraphs.all), with the
        stack given, at the smallest context a call of that size has (a graph first picked
        at a long context, for its fewer layers per graph, compiles as fast at a short one;
        its context axis is dynamic): (kind, size, context, lm_head rows, stack). Their
        decode steps run every lm_head and all run the embedding: running them compiles
        every graph a call can need."""
        return [(kind, size, context, size if kind == "decode" else 1, graph)
                for graph, (kind, size, context) in self.graph_of.all().items()
                if graph.part == "layers"]

    def cell(self, graph: Graph):
        """The Cell of `graph`, built with its inputs' dynamic shapes on first use."""
        cell = self.cells.get(graph)
        if cell is None:
            cell = self.cells[graph] = self._build(graph)
        return cell

    def _build(self, graph):
        """The Cell of `graph`, its inputs' axes static where the Graph fixes them and None
        (dynamic) where it does not."""
        ctx = dataclasses.replace(self.ctx, graph=graph)
        config = ctx.config
        rows, context = graph.rows or None, graph.context or None
        x = Tensor(shape=[rows, config.hidden_size], dtype=self.dtype)
        picked = Tensor(shape=[rows], dtype=ms.int32)  # token ids; the head's rows
        if graph.part == "embedding":
            cell = self.family.Embedding(ctx)
            cell.set_inputs(picked, self.embed_weight)
        elif graph.part == "head":
            cell = self.family.LMHead(ctx)
            cell.set_inputs(x, picked, *self.head_weights)
        else:
            cell = self.family.LayerStack(ctx, graph.layers)
            rotary = Tensor(shape=[rows, 1, config.head_dim],
                            dtype=ms.float16 if self.cos.dtype == np.float16 else ms.float32)
            kv = ctx.plan.local_kv_heads  # CacheLayout.head_rows, rows_by_head
            decode = graph.kind == "decode"
            groups = rows if decode else 1
            read = groups and context and groups * kv * context
            mask = [rows, 1, context] if decode else [1, rows, context]
            per_layer = self.args_per_layer * graph.layers
            cell.set_inputs(x, rotary, rotary, Tensor(shape=[rows and rows * kv], dtype=ms.int32),
                            Tensor(shape=[read], dtype=ms.int32),
                            Tensor(shape=mask, dtype=ms.float32), *self.layer_args[:per_layer])
        return cell

    def _run(self, ids, positions, write, context_slots, mask, rows, graph=None):
        cos, sin = self._rotary(positions)
        groups, queries, context = mask.shape
        # explicit mode's caches are rows of one head (kv_layout.py)
        args = (Tensor(self.layout.head_rows(write).astype(np.int32)),
                Tensor(self.layout.rows_by_head(context_slots, groups).astype(np.int32)),
                Tensor(mask))
        tokens = len(ids)
        graph = graph or self.graph_of.layers("decode" if queries == 1 else "prefill", tokens,
                                              context)
        stack, count = self.cell(graph), graph.layers
        x = self.cell(self.graph_of.embedding(tokens))(Tensor(ids), self.embed_weight)
        n = self.args_per_layer
        for first in range(0, self.num_layers, count):
            x = stack(x, cos, sin, *args, *self.layer_args[first * n:(first + count) * n])
        if rows is None:
            x.asnumpy()  # the call's cache writes done before the next call builds on them
            return None
        if len(rows) != tokens or (rows != np.arange(tokens)).any():
            # A prefill call's rows are picked first (one op, outside the graphs), so the
            # head's graph is one a decode step uses too (prefill_rows).
            x = ops.gather(x, Tensor(rows), 0)
            rows = np.arange(len(rows), dtype=np.int32)
        head = self.graph_of.head(len(rows))
        logits = self.cell(head)(x, Tensor(rows), *self.head_weights).asnumpy()
        return blocked_transpose(logits) if head.weight_first else logits


class SemiAutoRunner(ModelRunner):
    """semi_auto mode: one whole-model graph (the family's Model, e.g. Qwen2Model, owns its
    weights and caches as Parameters, laid out per rank by MindSpore from the primitives'
    in_strategy)."""

    needs_rows = True

    def prefill_rows(self, count, size):
        """The most rows a prefill call of `size` tokens can need (one per completing chunk:
        at most min(max_num_seqs, size)), whatever `count`: the whole-model graph includes
        the lm_head, and one row count per chunk bucket keeps one graph per (chunk, context).
        The rows beyond `count` are row 0 again, computed and dropped. A call that needs more
        (prompt logprobs) has a row for every token: one more graph for that (chunk,
        context), compiled when first asked (warm-up does not: few requests ask)."""
        largest = bucket_for(min(size, self.row_buckets[-1]), self.row_buckets)
        return size if count > largest else largest

    def __init__(self, ctx, layout, max_num_seqs, max_prefill_tokens, max_model_len, model,
                 world_size=1):
        super().__init__(ctx, layout, max_num_seqs, max_prefill_tokens, max_model_len)
        self.model = model
        self.cell = semi_auto_cell(model, world_size)

    @property
    def graphs(self):
        return [self.cell]

    def load(self, weights, world_size=1):
        """Set the Parameters from (name, full-or-slice array) pairs. In a job of several
        ranks the Parameters become this rank's slices once a graph is compiled with the
        plan's layouts: compile one shape first, then load the slices."""
        if world_size > 1:
            self.compile_shape("decode", self.batch_buckets[0], self.context_buckets[0])
        for name, array in weights:
            self.model.weights[name].set_data(Tensor(array, dtype=self.dtype))

    def _run(self, ids, positions, write, context_slots, mask, rows, graph=None):
        cos, sin = self._rotary(positions)
        return self.cell(Tensor(ids), cos, sin, Tensor(write.astype(np.int32)),
                         Tensor(context_slots.astype(np.int32)), Tensor(mask),
                         Tensor(rows)).asnumpy()


def build_runner(model_dir, ctx, layout, limits, world_size, profile):
    """The runner of `ctx.mode`, with this rank's weights loaded from `model_dir` and its KV
    cache allocated (`layout`): what nano-vllm's ModelRunner does in its constructor."""
    config = ctx.config
    family = family_of(config)
    names = family.weight_names(config)
    host_dtype = np.float16 if ctx.dtype == ms.float16 else np.float32  # numpy has no bf16
    if config.quantization is None:
        weights = rank_weights(model_dir, ctx.plan, ctx.tensor_rank, names, host_dtype)
    else:  # msModelSlim's tensors: a quantized projection's as a tuple (int8 weight, ...)
        weights = quantized_rank_weights(model_dir, ctx.plan, ctx.tensor_rank, names,
                                         host_dtype)
    sizes = dict(max_num_seqs=limits.max_num_seqs, max_prefill_tokens=limits.max_prefill_tokens,
                 max_model_len=limits.max_len)
    if ctx.mode == "semi_auto":
        model = family.Model(ctx, layout, full_shapes(config, names))
        runner = SemiAutoRunner(ctx, layout, model=model, world_size=world_size, **sizes)
        runner.load(weights, world_size)
        return runner
    loaded = {name: (tuple(ms.Tensor.from_numpy(a) for a in array) if isinstance(array, tuple)
                     else host_tensor(family.weight_layout(ctx, name, array), ctx.dtype))
              for name, array in weights}
    return ExplicitRunner(ctx, layout, weights=loaded,
                          min_layers_per_graph=profile.min_layers_per_graph,
                          layer_peak_growth=profile.layer_peak_growth,
                          dynamic=limits.graph_shapes == "dynamic", **sizes)


def flat(weights):
    """A layer's weights with each quantized one's tuple spread out."""
    return [t for w in weights for t in (w if isinstance(w, tuple) else (w,))]


def host_tensor(array, dtype):
    """A loaded weight as a Tensor of `dtype`, sharing the array's memory when it already is
    that dtype: a copy would write every weight's bytes to fresh pages once more (on a guest
    whose first touch of memory runs at 0.3 GB/s that was 6 of a 0.5B model's 17 s of load)."""
    if ms.dtype_to_nptype(dtype) == array.dtype:
        return ms.Tensor.from_numpy(array)  # (copies an array that is not C-contiguous)
    return ms.Tensor(array, dtype=dtype)


def blocked_transpose(columns, block=4096):
    """(rows, n) from (n, rows), copied in blocks of `block` that stay in cache: 1.6 ms for
    (151,936, 16) float32 where np.ascontiguousarray(columns.T) takes 6.0 ms."""
    out = np.empty(columns.shape[::-1], columns.dtype)
    for start in range(0, columns.shape[0], block):
        out[:, start:start + block] = columns[start:start + block].T
    return out


def semi_auto_cell(model, world_size):
    """The semi_auto model as MindSpore 2.10 asks for it: `AutoParallel(cell, "semi_auto")`
    sets the auto-parallel context only while that cell compiles, so nothing else (the job
    seed's AllReduce, compiled as a stand-alone graph) runs under it. full_batch: every rank
    feeds the whole step and MindSpore splits it per the primitives' in_strategy. Only for a
    job of several ranks (MindSpore: full_batch fails with one device)."""
    from mindspore.parallel.auto_parallel import AutoParallel

    if world_size < 2:
        return model
    cell = AutoParallel(model, parallel_mode="semi_auto")
    cell.dataset_strategy("full_batch")
    return cell
