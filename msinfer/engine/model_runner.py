"""The model runner: builds the model on this rank, loads its weight slices, owns the KV
cache, and turns one step's scheduled sequences into the tensors the compiled graphs take,
runs them and returns logits. Two runners behind one interface (`decode`, `prefill`,
`shapes`, `compile_shape`, `compilations`): `ExplicitRunner` and `SemiAutoRunner`;
`build_runner` makes the one a parallel mode needs.

Every call is padded to the GraphShape the planner's ShapePlan decides (planning/shapes.py:
its shape bucket, and in explicit mode the graphs that run it); the runner only executes it:
- decode: batch B (powers of two up to max_num_seqs) x context T (powers of two from 64 up to
  max_model_len): B sequences, one token each, each over its own T gathered cache slots;
- prefill: chunk C tokens (16, 32, 64, ... up to max_prefill_tokens; with speculative
  decoding from 2) x context T: the chunk's tokens (of one or several sequences) over their
  concatenated contexts, and the lm_head on R rows (the last token of each sequence whose
  prompt the chunk completes; powers of two).
In explicit mode a call is one embedding call, the decoder layers in stacks of k consecutive
layers (each layer's weights and KV cache passed in; k the fewest for a pass in a few calls,
within the planner's workspace for that shape: planning/workspace.py), and one lm_head call
(none for a prefill call that completes no prompt). Those graphs are of dynamic shape, so
their number does not grow with max_model_len (planning/shapes.ExplicitGraphs: dynamic in the
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
from ..engine_config import EngineLimits
from ..errors import MsinferError
from ..hardware import DTYPE_BYTES
from ..layers.attention import new_cache
from ..layers.cpu_forms import matmul_forms
from ..layers.linear_methods import table_dtype
from ..layers.parallel_context import ParallelContext
from ..layers.rotary import rotary_tables
from ..models.families import family_of
from ..models.loader import full_shapes, rank_weights
from ..models.quant_loader import quantized_rank_weights
from ..planning.kv_layout import TRASH_BLOCK, CacheLayout
from ..planning.shapes import ExplicitGraphs, Graph, ShapeBuckets, ShapePlan
from ..planning.workspace import stack_layers

MASKED = -1e30  # added to the float32 scores of context positions a query must not see


class ModelRunner:
    """What both runners share: a step's inputs built from the block tables, padded to the
    GraphShape the planner's ShapePlan gives (`shape_plan`), timings, compiling ahead. A
    subclass runs the padded call (`_run`)."""

    def __init__(self, ctx: ParallelContext, layout: CacheLayout, limits: EngineLimits,
                 speculative: bool = False):
        """`speculative`: the engine verifies proposals (speculative decoding), in prefill
        chunks of a few rows (ShapeBuckets.VERIFY_CHUNK)."""
        config = ctx.config
        self.ctx = ctx
        self.layout = layout
        self.dtype = ctx.dtype
        self.num_layers = config.num_layers
        self.family = family_of(config)  # models/qwen2.py, qwen3.py: the model's Cells
        cos, sin = rotary_tables(config.head_dim, config.rope_theta, limits.max_model_len,
                                 config.rope_scaling)
        host = np.float16 if str(ctx.dtype) == "Float16" else np.float32
        self.cos, self.sin = cos.astype(host), sin.astype(host)
        self.buckets = ShapeBuckets.for_engine(
            limits, step=ctx.plan.data if ctx.mode == "semi_auto" else 1,
            speculative=speculative)
        self.batch_buckets = self.buckets.batch
        self.context_buckets = self.buckets.context
        self.chunk_buckets = self.buckets.chunk
        self.row_buckets = self.buckets.rows
        self.shape_plan = ShapePlan(self.buckets)  # explicit mode's has its graphs
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

    # monotonic start of the call in progress if it compiles a graph (its first use: a lazy
    # start, or a head graph warm-up leaves out), else None; the server's stall watch waits
    # for it (server/lockstep.py StepWatch)
    compiling_since = None

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
        shape = self.shape_plan.decode(count, max(s.length for s in seqs))
        batch, context = shape.size, shape.context
        ids = np.zeros(batch, np.int32)
        positions = np.zeros(batch, np.int64)
        write = np.full(batch, self.write_slot, np.int64)
        slots = np.full((batch, context), self.zero_slot, np.int64)
        mask = np.full((batch, 1, context), MASKED, np.float32)
        for i, seq in enumerate(seqs):
            n = seq.length
            ids[i] = seq.last_token
            positions[i] = n - 1
            row_slots = self.layout.slots(seq.block_table, np.arange(n))
            write[i] = row_slots[-1]
            slots[i, :n] = row_slots
            mask[i, 0, :n] = 0.0
        rows = np.arange(batch, dtype=np.int32)
        start, compiled = time.perf_counter(), self.compilations
        logits = self._run(ids, positions, write, slots.reshape(-1), mask, rows, shape)[:count]
        self._time("decode", start, count, compiled, f"batch {batch} x context {context}")
        return logits

    def prefill(self, chunks) -> np.ndarray:
        """Runs the chunks (each writes its tokens' K/V); returns the logits rows of every
        chunk's `logit_positions()`, in chunk order: one row for each chunk that completes its
        sequence's pending tokens, and with prompt logprobs a row for each position scoring a
        prompt token before it (none at all: an empty array, and explicit mode skips the
        lm_head)."""
        total = sum(c.count for c in chunks)
        wanted = [c.logit_positions() for c in chunks]
        shape = self.shape_plan.prefill(total, sum(c.start + c.count for c in chunks),
                                        sum(map(len, wanted)))
        size, context = shape.size, shape.context
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
            ids[token:token + c.count] = c.token_ids()
            positions[token:token + c.count] = span
            write[token:token + c.count] = seq_slots[c.start:]
            owner[token:token + c.count] = i
            slots[filled:filled + end] = seq_slots
            context_owner[filled:filled + end] = i
            context_position[filled:filled + end] = np.arange(end)
            rows += [token + position - c.start for position in wanted[i]]
            token += c.count
            filled += end
        visible = ((owner[:, None] == context_owner[None, :])
                   & (context_position[None, :] <= positions[:, None]))
        mask = np.where(visible, 0.0, MASKED).astype(np.float32)[None]
        padded_rows = None  # no chunk completes its prompt: no logits are needed
        if shape.rows:
            padded_rows = np.zeros(shape.rows, np.int32)
            padded_rows[:len(rows)] = rows
        start, compiled = time.perf_counter(), self.compilations
        logits = self._run(ids, positions, write, slots, mask, padded_rows, shape)
        logits = logits[:len(rows)] if logits is not None else np.zeros((0, 0), np.float32)
        self._time("prefill", start, total, compiled, f"chunk {size} x context {context}")
        return logits

    def _time(self, kind, start, tokens, compiled_before, shape):
        self.compiling_since = None
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

    def _run(self, ids, positions, write, context_slots, mask, rows, shape):
        """mask (G, Q, T): G groups of Q queries, each over its own T context slots. Returns
        the logits of `rows`; None when rows is None (the lm_head is skipped). `shape`: the
        call's GraphShape (explicit mode runs its graphs)."""
        raise NotImplementedError

    # ---- compile ahead ----

    def shapes(self) -> list:
        """Every GraphShape warm-up runs (ShapePlan.warmup), so that serving compiles
        nothing."""
        return self.shape_plan.warmup()

    def compile_shape(self, shape) -> None:
        """Runs one padded call of `shape` (a GraphShape) that writes only the trash block's
        write slot and reads its zero slot."""
        size, context = shape.size, shape.context
        decode = shape.kind == "decode"
        mask = np.zeros((size, 1, context) if decode else (1, size, context), np.float32)
        slots = np.full(size * context if decode else context, self.zero_slot, np.int64)
        rows = np.zeros(shape.rows, np.int32) if shape.rows else None
        self._run(np.zeros(size, np.int32), np.zeros(size, np.int64),
                  np.full(size, self.write_slot, np.int64), slots, mask, rows, shape)
        self.compiling_since = None


class ExplicitRunner(ModelRunner):
    """Explicit mode: this rank's weight slices and KV caches as Tensors passed to the graphs;
    a call is an embedding graph, the layers in LayerStacks of k consecutive layers, and an
    lm_head graph. Each of those is a graph of dynamic shape (planning/shapes.py `Graph`),
    built and compiled when a call first needs it; warm-up runs one call for each."""

    def __init__(self, ctx, layout, limits, weights, min_layers_per_graph=1,
                 layer_peak_growth=1.0, speculative=False):
        """weights: {name: Tensor} of this rank's slices, in the layouts the graphs take
        (the family's weight_layout). `min_layers_per_graph`, `layer_peak_growth`: the
        hardware profile's.
        limits.graph_shapes "dynamic": graphs of dynamic shape, else one per call shape."""
        super().__init__(ctx, layout, limits, speculative)
        config = ctx.config
        family = self.family
        self.caches = [(new_cache(layout.rows_shape, ctx.dtype),
                        new_cache(layout.rows_shape, ctx.dtype))
                       for _ in range(config.num_layers)]
        self.embed_weight = weights[family.EMBEDDING_WEIGHT]
        self.layer_classes = family.layer_classes(config)  # a MoE's: dense or sparse
        # What makes layers share a graph: their class and quantization schemes
        self.layer_kinds = config.layer_kinds()
        self.layer_weights = [[weights[f"model.layers.{i}.{w}"] for w in layer.WEIGHTS]
                              for i, layer in enumerate(self.layer_classes)]
        self.head_weights = [weights[n] for n in family.head_weight_names(config)]
        # Each layer's arguments of a LayerStack: its K and V caches, then its weights.
        self.layer_args = [(k, v, *flat(w))
                           for (k, v), w in zip(self.caches, self.layer_weights)]
        # What the planner reserves for activations: each graph stays within it.
        self.layers_per_call = stack_layers(ctx.plan, DTYPE_BYTES[str(ctx.dtype).lower()],
                                            limits, min_layers_per_graph, layer_peak_growth)
        self.graph_of = ExplicitGraphs(self.buckets, self.layers_per_call, matmul_forms(ctx),
                                       limits.graph_shapes == "dynamic")
        self.shape_plan = ShapePlan(self.buckets, self.graph_of)
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
        """Embedding and head graphs, and a stack's graph for each run of layer kinds its
        stacks cover (one for a dense family whose layers share their quantization
        schemes)."""
        return sum(len(self._stack_kinds(g.layers)) if g.part == "layers" else 1
                   for g in self.graph_of.all())

    def _stack_kinds(self, count):
        return {self.layer_kinds[first:first + count]
                for first in range(0, self.num_layers, count)}

    def cell(self, graph: Graph, first=0):
        """The Cell of `graph` (a layer stack's: for the layers from `first`), built with its
        inputs' dynamic shapes on first use."""
        key = graph
        if graph.part == "layers" and first:
            kinds = self.layer_kinds[first:first + graph.layers]
            key = graph if kinds == self.layer_kinds[:graph.layers] else (graph, kinds)
        cell = self.cells.get(key)
        if cell is None:  # its first call compiles it
            self.compiling_since = self.compiling_since or time.monotonic()
            cell = self.cells[key] = self._build(graph, first)
        return cell

    def _stack_args(self, first, count):
        return [t for args in self.layer_args[first:first + count] for t in args]

    def _build(self, graph, first=0):
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
            classes = self.layer_classes[first:first + graph.layers]
            cell = self.family.LayerStack(ctx, graph.layers, classes, first)
            rotary = Tensor(shape=[rows, 1, config.head_dim],
                            dtype=ms.float16 if self.cos.dtype == np.float16 else ms.float32)
            kv = ctx.plan.local_kv_heads  # CacheLayout.head_rows, rows_by_head
            decode = graph.kind == "decode"
            groups = rows if decode else 1
            read = groups and context and groups * kv * context
            mask = [rows, 1, context] if decode else [1, rows, context]
            cell.set_inputs(x, rotary, rotary, Tensor(shape=[rows and rows * kv], dtype=ms.int32),
                            Tensor(shape=[read], dtype=ms.int32),
                            Tensor(shape=mask, dtype=ms.float32),
                            *self._stack_args(first, graph.layers))
        return cell

    def _run(self, ids, positions, write, context_slots, mask, rows, shape):
        cos, sin = self._rotary(positions)
        groups, queries, context = mask.shape
        # explicit mode's caches are rows of one head (kv_layout.py)
        args = (Tensor(self.layout.head_rows(write).astype(np.int32)),
                Tensor(self.layout.rows_by_head(context_slots, groups).astype(np.int32)),
                Tensor(mask))
        tokens = len(ids)
        graph = shape.stack
        count = graph.layers
        x = self.cell(shape.embedding)(Tensor(ids), self.embed_weight)
        for first in range(0, self.num_layers, count):
            x = self.cell(graph, first)(x, cos, sin, *args, *self._stack_args(first, count))
        if rows is None:
            x.asnumpy()  # the call's cache writes done before the next call builds on them
            return None
        if len(rows) != tokens or (rows != np.arange(tokens)).any():
            # A prefill call's rows are picked first (one op, outside the graphs), so the
            # head's graph is one a decode step uses too (ShapePlan.prefill_rows).
            x = ops.gather(x, Tensor(rows), 0)
            rows = np.arange(len(rows), dtype=np.int32)
        head = shape.head
        logits = self.cell(head)(x, Tensor(rows), *self.head_weights).asnumpy()
        return blocked_transpose(logits) if head.weight_first else logits


class SemiAutoRunner(ModelRunner):
    """semi_auto mode: one whole-model graph (the family's Model, e.g. Qwen2Model, owns its
    weights and caches as Parameters, laid out per rank by MindSpore from the primitives'
    in_strategy)."""

    def __init__(self, ctx, layout, limits, model, world_size=1):
        super().__init__(ctx, layout, limits)
        self.model = model
        self.cell = semi_auto_cell(model, world_size)
        self._shapes_run = set()  # (tokens, mask shape, rows) of the calls compiled

    @property
    def graphs(self):
        return [self.cell]

    def load(self, weights, world_size=1):
        """Set the Parameters from (name, full-or-slice array) pairs. In a job of several
        ranks the Parameters become this rank's slices once a graph is compiled with the
        plan's layouts: compile one shape first, then load the slices."""
        if world_size > 1:
            self.compile_shape(self.shape_plan.at("decode", self.batch_buckets[0],
                                                  self.context_buckets[0]))
        for name, array in weights:
            if not isinstance(array, tuple):
                self.model.weights[name].set_data(Tensor(array, dtype=self.dtype))
                continue
            for param, part in zip(self.model.weights[name], array):  # a quantized one's
                if param.name.endswith("_scale") and part.shape[-1] != param.shape[-1]:
                    raise MsinferError(f"{param.name}: {part.shape[-1]} groups of scales; "
                                       f"semi_auto lays out per-channel scales only (group-"
                                       f"wise W8A16 runs in parallel_mode explicit)")
                param.set_data(Tensor(part, dtype=param.dtype))

    def _run(self, ids, positions, write, context_slots, mask, rows, shape):
        cos, sin = self._rotary(positions)
        key = (len(ids), mask.shape, None if rows is None else len(rows))
        if key not in self._shapes_run:  # the whole model's graph of a new shape compiles
            self._shapes_run.add(key)
            self.compiling_since = self.compiling_since or time.monotonic()
        return self.cell(Tensor(ids), cos, sin, Tensor(write.astype(np.int32)),
                         Tensor(context_slots.astype(np.int32)), Tensor(mask),
                         Tensor(rows)).asnumpy()


def build_runner(model_dir, ctx, layout, limits, world_size, profile, speculative=False):
    """The runner of `ctx.mode`, with this rank's weights loaded from `model_dir` and its KV
    cache allocated (`layout`): what nano-vllm's ModelRunner does in its constructor.
    `speculative`: its calls verify proposals (explicit mode only: the planner refuses
    speculation in semi_auto)."""
    config = ctx.config
    family = family_of(config)
    names = family.weight_names(config)
    host_dtype = np.float16 if ctx.dtype == ms.float16 else np.float32  # numpy has no bf16
    # A quantized checkpoint's FLOAT embedding and lm_head: 16-bit where kernels read them.
    table = table_dtype(ctx)
    tables = {family.EMBEDDING_WEIGHT, family.head_weight_names(config)[-1]} if table else set()
    if config.quantization is None:
        weights = rank_weights(model_dir, ctx.plan, ctx.tensor_rank, names, host_dtype)
    else:  # msModelSlim's tensors: a quantized projection's as a tuple (int8 weight, ...)
        weights = quantized_rank_weights(
            model_dir, ctx.plan, ctx.tensor_rank, names, host_dtype, tables,
            table and ms.dtype_to_nptype(table), bias_on_rank_0=ctx.mode == "explicit")
    if ctx.mode == "semi_auto":
        model = family.Model(ctx, layout, full_shapes(config, names))
        runner = SemiAutoRunner(ctx, layout, limits, model=model, world_size=world_size)
        runner.load(weights, world_size)
        return runner
    loaded = {name: (tuple(ms.Tensor.from_numpy(a) for a in array) if isinstance(array, tuple)
                     else host_tensor(family.weight_layout(ctx, name, array),
                                      table if name in tables else ctx.dtype))
              for name, array in weights}
    return ExplicitRunner(ctx, layout, limits, weights=loaded,
                          min_layers_per_graph=profile.min_layers_per_graph,
                          layer_peak_growth=profile.layer_peak_growth, speculative=speculative)


def flat(weights):
    """A layer's weights with each quantized one's tuple spread out."""
    return [t for w in weights for t in (w if isinstance(w, tuple) else (w,))]


def host_tensor(array, dtype):
    """A loaded weight as a Tensor of `dtype`, sharing the array's memory when it already is
    that dtype: a copy would write every weight's bytes to fresh pages once more (slow on
    guests whose first touch of memory is slow)."""
    if ms.dtype_to_nptype(dtype) == array.dtype:
        return ms.Tensor.from_numpy(array)  # (copies an array that is not C-contiguous)
    return ms.Tensor(array, dtype=dtype)


def blocked_transpose(columns, block=4096):
    """(rows, n) from (n, rows), copied in blocks of `block` that stay in cache (faster than
    np.ascontiguousarray(columns.T), which strides through the whole array per row)."""
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
