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

from ..layers.attention import new_cache
from ..layers.cpu_forms import matmul_forms
from ..layers.embedding import ParallelEmbedding
from ..layers.linear import ParallelLinear
from ..layers.mlp import SwiGLU
from ..layers.linear_methods import full_tensors, tensor_suffixes
from ..layers.norm import RMSNorm
from ..layers.parallel_context import SemiAutoLayout, shard
from ..layers.self_attention import SelfAttention

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


def layer_weight_tensors(config, weight, layer):
    """The checkpoint suffixes a weight of decoder layer `layer` (a LAYER_WEIGHTS entry) is
    loaded as: ("weight",) for a float one; a quantized projection's scheme's tensors
    (layers/linear_methods.py)."""
    quantization = config.quantization
    if quantization is None or not weight.endswith(".weight"):
        return (weight.rsplit(".", 1)[1],)
    return tensor_suffixes(quantization.scheme_at(f"model.layers.{layer}.{weight}"))


def layer_weight_names(layer: int) -> list:
    return [f"model.layers.{layer}.{w}" for w in LAYER_WEIGHTS]


def head_weight_names(config) -> list:
    """The final norm and the lm_head (the embedding itself when tied)."""
    lm_head = EMBEDDING_WEIGHT if config.tie_word_embeddings else "lm_head.weight"
    return ["model.norm.weight", lm_head]


def layer_classes(config) -> tuple:
    """The decoder-layer Cell of each layer (a MoE family mixes dense and sparse layers)."""
    return (DecoderLayer,) * config.num_layers


def weight_names(config, layer_names=layer_weight_names) -> list:
    """Every weight the model takes, each once, in load order (`layer_names`: a family's
    layer_weight_names)."""
    names = [EMBEDDING_WEIGHT]
    for n in range(config.num_layers):
        names += layer_names(n)
    return names + [n for n in head_weight_names(config) if n not in names]


class DecoderLayer(nn.Cell):
    """Qwen2's decoder layer: RMSNorm, self-attention, residual, RMSNorm, MLP, residual. A
    family whose layer differs in a step (Qwen3: no q/k/v bias, q/k norms; a MoE's sparse
    MLP) subclasses it: its own `WEIGHTS` and `construct`, over the shared steps (`_qkv`,
    `_attend`, `_residual_mlp`)."""

    WEIGHTS = LAYER_WEIGHTS  # the weights construct takes, in order
    QKV_BIAS = True

    def __init__(self, ctx, layer=0):
        """`layer`: a decoder layer this Cell runs; its projections take that layer's
        quantization schemes, which every layer of its kind shares (ModelConfig.layer_kinds)."""
        super().__init__()
        self.layer_prefix = f"model.layers.{layer}"
        self.input_norm = RMSNorm(ctx)
        self.post_attention_norm = RMSNorm(ctx)
        self.self_attn = SelfAttention(ctx, bias=self.QKV_BIAS,
                                       prefix=self.layer_prefix + ".self_attn")
        self.mlp = self._make_mlp(ctx)
        rows = SemiAutoLayout(ctx.plan).rows(2) if ctx.mode == "semi_auto" else None
        self.residual = shard(ctx, ops.Add(), rows, rows)

    def _make_mlp(self, ctx):
        return SwiGLU(ctx, self.layer_prefix + ".mlp")

    def construct(self, x, cos, sin, k_cache, v_cache, write_rows, context_rows, mask,
                  ln1, w_qkv, b_qkv, w_o, ln2, w_gate_up, w_down):
        """x: (N, hidden) with N = G*Q tokens; cos/sin: (N, 1, head_dim); write_rows: (N,)
        slots of the tokens' own K/V; context_rows: the T context slots of each group, (G*T,);
        in explicit mode, whose caches are (slots x kv, head_dim), the rows of those
        (CacheLayout.head_rows, N*kv; rows_by_head, G*kv*T); mask: (G, Q, T), 0 where a query
        may look and a large negative number elsewhere."""
        q, k, v = self._qkv(x, ln1, w_qkv, b_qkv)
        x = self._attend(x, q, k, v, cos, sin, k_cache, v_cache, write_rows, context_rows,
                         mask, w_o)
        return self._residual_mlp(x, ln2, w_gate_up, w_down)

    def _qkv(self, x, ln1, w_qkv, b_qkv):
        return self.self_attn.qkv(self.input_norm(x, ln1), w_qkv, b_qkv)

    def _attend(self, x, q, k, v, cos, sin, k_cache, v_cache, write_rows, context_rows, mask,
                w_o):
        """x plus the attention's output."""
        return self.residual(x, self.self_attn.attend(q, k, v, cos, sin, k_cache, v_cache,
                                                      write_rows, context_rows, mask, w_o))

    def _residual_mlp(self, x, ln2, *mlp_weights):
        """x plus the MLP of its norm."""
        return self.residual(x, self.mlp(self.post_attention_norm(x, ln2), *mlp_weights))


class LayerStack(nn.Cell):
    """`count` consecutive decoder layers as one graph, built for the layers from `first`
    (`layers`: their classes, a family's layer_classes; default `count` of LAYER). After the
    call's inputs come, per layer, its K cache, its V cache and its weights (its class's
    WEIGHTS order; a quantized projection's as its scheme's tensors): all Tensors, so
    MindSpore compiles the graph once for every run of `count` layers of the same kinds
    (ModelConfig.layer_kinds) and passes them without a copy (a Parameter argument would
    compile once per Parameter; a tuple argument is a constant, compiled per value).

    Each position is its own DecoderLayer (primitives only, no weights): one Cell called
    `count` times with Tensor caches that it updates makes MindSpore copy every cache at every
    call, which made a decode step's time grow with the KV pool (measured: docs/engine.md,
    "Measured figures behind the code")."""

    LAYER = DecoderLayer

    def __init__(self, ctx, count, layers=None, first=0):
        super().__init__()
        layers = layers or (self.LAYER,) * count
        self.layers = nn.CellList([layer(ctx, first + i) for i, layer in enumerate(layers)])
        self.count = count
        # Tensors per layer weight: a quantized projection's come as its method's tuple.
        self.arity = tuple(tuple(len(layer_weight_tensors(ctx.config, w, first + i))
                                 for w in c.WEIGHTS) for i, c in enumerate(layers))
        self.args = tuple(2 + sum(arity) for arity in self.arity)
        self.firsts = tuple(sum(self.args[:i]) for i in range(count))

    def construct(self, x, cos, sin, write_slots, context_slots, mask, *per_layer):
        for i in range(self.count):
            args = per_layer[self.firsts[i]:self.firsts[i] + self.args[i]]
            x = self.layers[i](x, cos, sin, args[0], args[1], write_slots, context_slots, mask,
                               *grouped(args[2:], self.arity[i]))
        return x


def grouped(flat, arity):
    """A layer's flat weight tensors grouped per weight (a tuple for a quantized one)."""
    found = ()
    start = 0
    for count in arity:
        found = found + ((flat[start] if count == 1 else flat[start:start + count]),)
        start += count
    return found


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


def weight_params(config, layer, weight, shapes, param, dtype):
    """The semi_auto Parameters of `weight` of decoder layer `layer`, made by `param(name,
    shape=None, dtype=None)`: itself, or a quantized projection's tensors whole
    (linear_methods.full_tensors), as MindSpore takes them under semi_auto."""
    name = f"model.layers.{layer}.{weight}"
    suffixes = layer_weight_tensors(config, weight, layer)
    if len(suffixes) == 1 and name.endswith(suffixes[0]):
        return [param(name)]
    base = name[:-len("weight")]
    scheme = config.quantization.scheme_at(name)
    return [param(base + suffix, size, kind)
            for suffix, size, kind in full_tensors(scheme, shapes[name], dtype)]


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
        # A decoder-layer Cell per kind of layer (ModelConfig.layer_kinds: a quantized
        # checkpoint may leave some layers' projections float), built for its first layer.
        first_of = {}
        for n, kind in enumerate(config.layer_kinds()):
            first_of.setdefault(kind, n)
        self.layers = nn.CellList([self.LAYER(ctx, n) for n in first_of.values()])
        self.layer_cell = tuple(list(first_of).index(k) for k in config.layer_kinds())
        self.head = LMHead(ctx)

        def param(name, shape=None, dtype=None):
            return Parameter(Tensor(shape=shape or shapes[name], dtype=dtype or ctx.dtype,
                                    init=Zero()), name=name, requires_grad=False)

        self.embed_weight = param(EMBEDDING_WEIGHT)
        self.weights = {EMBEDDING_WEIGHT: self.embed_weight}
        holders, arities = [], []
        for n in range(config.num_layers):
            flat, arity = [], []
            for w in self.LAYER.WEIGHTS:
                tensors = weight_params(config, n, w, shapes, param, ctx.dtype)
                self.weights[f"model.layers.{n}.{w}"] = (tensors[0] if len(tensors) == 1
                                                         else tuple(tensors))
                flat += tensors
                arity.append(len(tensors))
            params = ms.ParameterTuple(flat)
            setattr(self, f"layer{n}_weights", params)  # registered with the Cell
            holders.append(params)
            arities.append(tuple(arity))
        self.layer_params = tuple(holders)
        self.arity = tuple(arities)
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
            x = self.layers[self.layer_cell[n]](
                x, cos, sin, self.k_caches[n], self.v_caches[n], write_slots, context_slots,
                mask, *grouped(self.layer_params[n], self.arity[n]))
        return self.head(x, logit_rows, self.norm_weight, self.lm_weight)


Model = Qwen2Model  # the family's whole-model Cell (models/families.py)
