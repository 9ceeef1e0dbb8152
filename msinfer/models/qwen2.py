"""Qwen2 for causal LM as MindSpore Cells over a paged KV cache: one model family, composed
from the shared layers (layers/: parallel linear and embedding, RMSNorm, rotary, paged
attention).

The math reads like Hugging Face's `modeling_qwen2.py`: embedding, decoder layers (RMSNorm,
rotary attention with grouped KV heads and q/k/v biases, SwiGLU MLP), final norm, lm_head
(tied to the embedding when the config says so). Two projections are fused: q/k/v is one
column-parallel matmul and gate/up another (each rank's part of each is cut by the shard
plan), so a layer runs 4 weight matmuls instead of 7.

The Cells hold primitives, not weights: weights and KV caches are arguments, so one compiled
graph of a `LayerStack` (k consecutive decoder layers) serves every run of k layers. That is
how the engine runs in explicit mode: a pass over the layers in a few graph calls, fewer
layers per graph where their activations would exceed the workspace (planning/workspace.py):
one layer of the largest prefill chunk (two on CPU), a quarter of the layers of a short decode
step. In semi_auto mode `Qwen2Model` owns the weights and caches as Parameters (so MindSpore
can lay them out per rank) and runs all layers in one graph.
"""
import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero
from mindspore.ops.auto_generate import SiLU  # the primitive behind ops.silu (not in ops)

from ..layers.attention import PagedAttention, new_cache
from ..layers.cpu_forms import matmul_forms
from ..layers.embedding import ParallelEmbedding
from ..layers.linear import ParallelLinear
from ..layers.linear_methods import tensor_suffixes
from ..layers.norm import RMSNorm
from ..layers.parallel_context import SemiAutoLayout, shard
from ..layers.rotary import Rotary

EMBEDDING_WEIGHT = "model.embed_tokens.weight"
# One decoder layer's weights, in the order DecoderLayer takes them.
LAYER_WEIGHTS = ("input_layernorm.weight", "self_attn.qkv_proj.weight",
                 "self_attn.qkv_proj.bias", "self_attn.o_proj.weight",
                 "post_attention_layernorm.weight", "mlp.gate_up_proj.weight",
                 "mlp.down_proj.weight")


# The decoder-layer projections that explicit mode on CPU may keep as (in, out), the
# checkpoint's (out, in) transposed once at load, where x @ W is the fastest product
# (hardware.cpu_matmul_forms). The lm_head stays (out, in): it is the embedding when tied.
IN_OUT_WEIGHTS = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                  "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def weight_layout(ctx, name, array):
    """A loaded weight (out, in) in the layout this process's graphs take."""
    forms = matmul_forms(ctx)
    if forms is not None and forms.in_out and name.endswith(IN_OUT_WEIGHTS):
        return np.ascontiguousarray(array.T)
    return array


def layer_weight_tensors(config, weight):
    """The checkpoint suffixes a layer weight (a LAYER_WEIGHTS entry) is loaded as: ("weight",)
    for a float one; a quantized projection's scheme's tensors (layers/linear_methods.py)."""
    quantization = config.quantization
    module = weight.rsplit(".", 1)[0]
    if quantization is None or not weight.endswith(".weight"):
        return (weight.rsplit(".", 1)[1],)
    scheme = quantization.scheme_of(module)
    return tensor_suffixes(scheme)


def layer_weight_names(layer: int) -> list:
    return [f"model.layers.{layer}.{w}" for w in LAYER_WEIGHTS]


def head_weight_names(config) -> list:
    """The final norm and the lm_head (the embedding itself when tied)."""
    lm_head = EMBEDDING_WEIGHT if config.tie_word_embeddings else "lm_head.weight"
    return ["model.norm.weight", lm_head]


def weight_names(config, layer_names=layer_weight_names) -> list:
    """Every weight the model takes, each once, in load order (`layer_names`: a family's
    layer_weight_names)."""
    names = [EMBEDDING_WEIGHT]
    for n in range(config.num_layers):
        names += layer_names(n)
    return names + [n for n in head_weight_names(config) if n not in names]


class DecoderLayer(nn.Cell):
    """Qwen2's decoder layer. A family whose layer differs in a step (Qwen3: no q/k/v bias,
    q/k norms) subclasses it: its own `WEIGHTS` and `construct`, over the shared steps
    (`_qkv`, `_attend_and_mlp`)."""

    WEIGHTS = LAYER_WEIGHTS  # the weights construct takes, in order
    QKV_BIAS = True

    def __init__(self, ctx):
        super().__init__()
        config, plan = ctx.config, ctx.plan
        p = "model.layers.0."
        self.input_norm = RMSNorm(ctx)
        self.post_attention_norm = RMSNorm(ctx)
        forms = matmul_forms(ctx)
        in_out = forms is not None and forms.in_out  # IN_OUT_WEIGHTS
        mlp = dict(in_out=in_out, weight_first=forms.mlp_weight_first if forms else None)
        self.qkv_proj = ParallelLinear(ctx, p + "self_attn.qkv_proj", bias=self.QKV_BIAS,
                                       in_out=in_out)
        self.o_proj = ParallelLinear(ctx, p + "self_attn.o_proj", in_out=in_out)
        self.gate_up_proj = ParallelLinear(ctx, p + "mlp.gate_up_proj", **mlp)
        self.down_proj = ParallelLinear(ctx, p + "mlp.down_proj", **mlp)
        self.rotary = Rotary(ctx)
        self.head_dim = config.head_dim
        self.explicit = ctx.mode == "explicit"
        if self.explicit:  # this rank's slices: one block of each fused output
            self.heads, self.kv_heads = plan.local_heads, plan.local_kv_heads
            self.intermediate = plan.local_shape(p + "mlp.down_proj.weight")[1]
            self.qkv_blocks = self.mlp_blocks = 1
        else:  # full shapes, laid out by MindSpore; a fused output is one block per rank
            self.heads, self.kv_heads = config.num_heads, config.num_kv_heads
            self.intermediate = config.intermediate_size
            layout = SemiAutoLayout(plan)
            self.qkv_blocks, self.mlp_blocks = layout.heads, layout.mlp
        # Widths within one block of the fused outputs.
        self.q_block = self.heads * self.head_dim // self.qkv_blocks
        self.kv_block = self.kv_heads * self.head_dim // self.qkv_blocks
        self.mlp_block = self.intermediate // self.mlp_blocks
        self.attention = PagedAttention(ctx, self.heads, self.kv_heads, self.head_dim)
        # The MLP's form: fixed for a graph of dynamic shape, else by its rows when it compiles
        self.weight_first = ctx.graph.weight_first if ctx.graph is not None else None
        self._make_primitives(ctx)

    def _make_primitives(self, ctx):
        semi_auto = ctx.mode == "semi_auto"
        layout = SemiAutoLayout(ctx.plan) if semi_auto else None
        rows = layout.rows(2) if semi_auto else None
        mlp = layout.mlp_blocks() if semi_auto else None
        self.split_qkv = shard(ctx, ops.StridedSlice(), layout.per_head(3, 1) if semi_auto
                               else None)
        self.residual = shard(ctx, ops.Add(), rows, rows)
        self.split_gate_up = shard(ctx, ops.StridedSlice(), mlp)
        self.silu = shard(ctx, SiLU(), mlp)
        self.gate = shard(ctx, ops.Mul(), mlp, mlp)
        self.mlp_out = ops.Transpose()  # explicit mode only (_mlp's weight-first chain)
        # Explicit mode cuts its one block of the fused outputs with constant begins and
        # ends (all rows: the mask bit of axis 0): in a graph of dynamic shape an end built
        # from x.shape is a Shape, a RealTupleGetItem and a RealMakeTuple kernel each call.
        self.columns = ops.StridedSlice(begin_mask=1, end_mask=1)
        self.halves_of_rows = ops.Split(0, 2)
        self.halves_of_columns = ops.Split(-1, 2)

    def construct(self, x, cos, sin, k_cache, v_cache, write_rows, context_rows, mask,
                  ln1, w_qkv, b_qkv, w_o, ln2, w_gate_up, w_down):
        """x: (N, hidden) with N = G*Q tokens; cos/sin: (N, 1, head_dim); write_rows: (N,)
        slots of the tokens' own K/V; context_rows: the T context slots of each group, (G*T,);
        in explicit mode, whose caches are (slots x kv, head_dim), the rows of those
        (CacheLayout.head_rows, N*kv; rows_by_head, G*kv*T); mask: (G, Q, T), 0 where a query
        may look and a large negative number elsewhere."""
        q, k, v = self._qkv(x, ln1, w_qkv, b_qkv)
        return self._attend_and_mlp(x, q, k, v, cos, sin, k_cache, v_cache, write_rows,
                                    context_rows, mask, w_o, ln2, w_gate_up, w_down)

    def _qkv(self, x, ln1, w_qkv, b_qkv):
        """q (tokens, heads, head_dim), k and v (tokens, kv_heads, head_dim) of the normed x
        (b_qkv None: no bias)."""
        qkv = self.qkv_proj(self.input_norm(x, ln1), w_qkv, b_qkv)
        if self.explicit:  # this rank's one block, cut by columns over all rows
            d = self.head_dim
            q_end, k_end = self.q_block, self.q_block + self.kv_block
            q = self.columns(qkv, (0, 0), (1, q_end), (1, 1))
            k = self.columns(qkv, (0, q_end), (1, k_end), (1, 1))
            v = self.columns(qkv, (0, k_end), (1, k_end + self.kv_block), (1, 1))
            return (q.reshape(-1, self.heads, d), k.reshape(-1, self.kv_heads, d),
                    v.reshape(-1, self.kv_heads, d))
        tokens = x.shape[0]
        qkv = qkv.reshape(tokens, self.qkv_blocks, -1)
        q = self._block_part(qkv, 0, self.q_block).reshape(tokens, self.heads, self.head_dim)
        k = self._block_part(qkv, self.q_block, self.kv_block)
        v = self._block_part(qkv, self.q_block + self.kv_block, self.kv_block)
        k = k.reshape(tokens, self.kv_heads, self.head_dim)
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        return q, k, v

    def _attend_and_mlp(self, x, q, k, v, cos, sin, k_cache, v_cache, write_rows,
                        context_rows, mask, w_o, ln2, w_gate_up, w_down):
        """The rest of the layer from q, k, v: rotary, paged attention, o_proj and residual,
        then the MLP and its residual."""
        q = self.rotary(q, cos, sin)
        k = self.rotary(k, cos, sin)
        out = self.attention(q, k, v, k_cache, v_cache, write_rows, context_rows, mask)
        x = self.residual(x, self.o_proj(out, w_o))
        return self.residual(x, self._mlp(self.post_attention_norm(x, ln2), w_gate_up, w_down))

    def _mlp(self, x, w_gate_up, w_down):
        weight_first = self.weight_first
        if weight_first is None:  # a graph of static shape: by its rows
            weight_first = self.gate_up_proj.weight_first_for(x.shape[0])
        if weight_first:  # explicit mode on CPU: one block
            # Transposed from gate/up to down, so one Transpose (of the output) for the MLP.
            gate_up = self.gate_up_proj.transposed(x, w_gate_up)  # (2 x intermediate, tokens)
            gate, up = self.halves_of_rows(gate_up)
            act = self.gate(self.silu(gate), up)
            return self.mlp_out(self.down_proj.transposed(act, w_down, x_transposed=True),
                                (1, 0))
        if self.explicit:  # one block
            gate, up = self.halves_of_columns(self.gate_up_proj(x, w_gate_up))
            return self.down_proj(self.gate(self.silu(gate), up), w_down)
        tokens = x.shape[0]
        gate_up = self.gate_up_proj(x, w_gate_up).reshape(tokens, self.mlp_blocks, -1)
        act = self.gate(self.silu(self._mlp_part(gate_up, 0)),
                        self._mlp_part(gate_up, self.mlp_block))
        return self.down_proj(act.reshape(tokens, -1), w_down)

    def _block_part(self, qkv, start, width):
        """Columns [start, start + width) of every rank block of the fused q/k/v output."""
        tokens, blocks, _ = qkv.shape
        return self.split_qkv(qkv, (0, 0, start), (tokens, blocks, start + width), (1, 1, 1))

    def _mlp_part(self, gate_up, start):
        tokens, blocks, _ = gate_up.shape
        return self.split_gate_up(gate_up, (0, 0, start),
                                  (tokens, blocks, start + self.mlp_block), (1, 1, 1))


class LayerStack(nn.Cell):
    """`count` consecutive decoder layers as one graph. After the call's inputs come, per
    layer, its K cache, its V cache and its weights (`LAYER_WEIGHTS` order): all Tensors, so
    MindSpore compiles the graph once for every run of `count` layers and passes them without
    a copy (a Parameter argument would compile once per Parameter; a tuple argument is a
    constant, compiled per value).

    Each position is its own DecoderLayer (primitives only, no weights): one Cell called
    `count` times with Tensor caches that it updates makes MindSpore copy every cache at every
    call (measured: 6 calls over 128 MB caches took 78 ms; 6 distinct Cells 1.0 ms, the same at
    8 MB), which made a decode step's time grow with the KV pool."""

    LAYER = DecoderLayer
    ARGS_PER_LAYER = 2 + len(LAYER.WEIGHTS)  # of a float checkpoint (args_per_layer)

    def __init__(self, ctx, count):
        super().__init__()
        self.layers = nn.CellList([self.LAYER(ctx) for _ in range(count)])
        self.count = count
        # Tensors per layer weight: a quantized projection's come as its method's tuple.
        self.arity = tuple(len(layer_weight_tensors(ctx.config, w)) for w in self.LAYER.WEIGHTS)
        self.args_per_layer = 2 + sum(self.arity)

    def construct(self, x, cos, sin, write_slots, context_slots, mask, *per_layer):
        n = self.args_per_layer
        for i in range(self.count):
            args = per_layer[i * n:(i + 1) * n]
            x = self.layers[i](x, cos, sin, args[0], args[1], write_slots, context_slots, mask,
                               *self._grouped(args[2:]))
        return x

    def _grouped(self, flat):
        """A layer's flat weight tensors grouped per weight (a tuple for a quantized one)."""
        grouped = ()
        start = 0
        for count in self.arity:
            grouped = grouped + ((flat[start] if count == 1 else flat[start:start + count]),)
            start += count
        return grouped


class Embedding(nn.Cell):
    def __init__(self, ctx):
        super().__init__()
        self.embed = ParallelEmbedding(ctx, "model.embed_tokens")

    def construct(self, ids, weight):
        return self.embed(ids, weight)


class LMHead(nn.Cell):
    """Final norm and lm_head over the rows that need logits; float32 logits, under semi_auto
    whole on every rank (a graph returns each rank's slice of what it computes: the last
    primitive's strategy gathers them; an Identity, which MindSpore's optimizer keeps where it
    drops a float32-to-float32 Cast)."""

    def __init__(self, ctx):
        super().__init__()
        semi_auto = ctx.mode == "semi_auto"
        data = SemiAutoLayout(ctx.plan).data if semi_auto else 1
        self.norm = RMSNorm(ctx)
        forms = matmul_forms(ctx)
        self.lm_head = ParallelLinear(ctx, "lm_head",
                                      weight_first=forms.head_weight_first if forms else None)
        self.pick_rows = shard(ctx, ops.Gather(), (1, 1), (data,))
        self.to_float = shard(ctx, ops.Cast(), (1, 1))
        self.whole = shard(ctx, ops.Identity(), (1, 1)) if semi_auto else None
        self.weight_first = ctx.graph.weight_first if ctx.graph is not None else None

    def transposed_for(self, rows):
        """Whether logits of `rows` rows come back as (vocab, rows): explicit mode on CPU
        computes them weight first, and the host transposes them as it copies them out. A
        graph of dynamic shape has one form for all its row counts."""
        if self.weight_first is not None:
            return self.weight_first
        return self.lm_head.weight_first_for(rows)

    def construct(self, x, rows, norm_weight, lm_weight):
        x = self.pick_rows(x, rows, 0)
        x = self.norm(x, norm_weight)
        if self.transposed_for(x.shape[0]):
            logits = self.lm_head.transposed(x, lm_weight)
        else:
            logits = self.lm_head(x, lm_weight)
        logits = self.to_float(logits, ms.float32)
        if self.whole is not None:
            logits = self.whole(logits)
        return logits


class Qwen2Model(nn.Cell):
    """The whole model in one graph, owning its weights as Parameters (semi_auto mode).

    construct(ids, cos, sin, write_slots, context_slots, mask, logit_rows) -> float32 logits
    of the rows `logit_rows`. `layout` sizes each layer's cache; its Parameters hold every KV
    head (MindSpore splits them by head over the tensor ranks, as the layer's cache primitives
    say)."""

    LAYER = DecoderLayer

    def __init__(self, ctx, layout, shapes):
        super().__init__()
        config = ctx.config
        self.embedding = Embedding(ctx)
        self.layer = self.LAYER(ctx)
        self.head = LMHead(ctx)

        def param(name):
            return Parameter(Tensor(shape=shapes[name], dtype=ctx.dtype, init=Zero()),
                             name=name, requires_grad=False)

        self.embed_weight = param(EMBEDDING_WEIGHT)
        self.weights = {EMBEDDING_WEIGHT: self.embed_weight}
        holders = []
        for n in range(config.num_layers):
            params = ms.ParameterTuple([param(f"model.layers.{n}.{w}")
                                        for w in self.LAYER.WEIGHTS])
            setattr(self, f"layer{n}_weights", params)  # registered with the Cell
            self.weights.update({p.name: p for p in params})
            holders.append(params)
        self.layer_params = tuple(holders)
        norm_name, lm_name = head_weight_names(config)
        self.norm_weight = param(norm_name)
        self.weights[norm_name] = self.norm_weight
        self.lm_weight = (self.embed_weight if config.tie_word_embeddings else param(lm_name))
        self.weights[lm_name] = self.lm_weight
        shape = (layout.num_slots, config.num_kv_heads, config.head_dim)
        self.k_caches = ms.ParameterTuple([new_cache(shape, ctx.dtype, f"k_cache.{n}")
                                           for n in range(config.num_layers)])
        self.v_caches = ms.ParameterTuple([new_cache(shape, ctx.dtype, f"v_cache.{n}")
                                           for n in range(config.num_layers)])

    def construct(self, ids, cos, sin, write_slots, context_slots, mask, logit_rows):
        x = self.embedding(ids, self.embed_weight)
        for n in range(len(self.layer_params)):
            x = self.layer(x, cos, sin, self.k_caches[n], self.v_caches[n], write_slots,
                           context_slots, mask, *self.layer_params[n])
        return self.head(x, logit_rows, self.norm_weight, self.lm_weight)


Model = Qwen2Model  # the family's whole-model Cell (models/families.py)
