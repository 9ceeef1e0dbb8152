"""Qwen2 for causal LM as MindSpore Cells over a paged KV cache.

The math reads like Hugging Face's `modeling_qwen2.py`: embedding, decoder layers (RMSNorm,
rotary attention with grouped KV heads and q/k/v biases, SwiGLU MLP), final norm, lm_head
(tied to the embedding when the config says so). Two projections are fused: q/k/v is one
column-parallel matmul and gate/up another (each rank's part of each is cut by the shard
plan), so a layer runs 4 weight matmuls instead of 7. Sharding lives in `parallel_layers`.

The Cells hold primitives, not weights: weights are arguments (`LAYER_WEIGHTS` order), so
one compiled graph of `DecoderLayer` serves all layers. That is how the engine runs in
explicit mode: a call per layer keeps what a compiled graph holds (on MindSpore's CPU backend,
every intermediate of the graph at once) to one layer of one chunk. In semi_auto mode
`Qwen2Model` owns the weights as Parameters (so MindSpore can lay them out per rank) and runs
all layers in one graph.

Attention of one call works on G groups of Q queries, each group over its own gathered
context of T cache slots: a prefill chunk is G=1 (the chunk's tokens, possibly of several
sequences, over the concatenation of their contexts, with a mask keeping each token to its own
sequence's earlier positions); a decode step is G=batch, Q=1.
"""
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero

from .parallel_layers import ParallelEmbedding, ParallelLinear

# One decoder layer's weights, in the order DecoderLayer takes them.
LAYER_WEIGHTS = ("input_layernorm.weight", "self_attn.qkv_proj.weight",
                 "self_attn.qkv_proj.bias", "self_attn.o_proj.weight",
                 "post_attention_layernorm.weight", "mlp.gate_up_proj.weight",
                 "mlp.down_proj.weight")


def layer_weight_names(layer: int) -> list:
    return [f"model.layers.{layer}.{w}" for w in LAYER_WEIGHTS]


def head_weight_names(config) -> list:
    """The final norm and the lm_head (the embedding itself when tied)."""
    lm_head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    return ["model.norm.weight", lm_head]


def rotary_tables(head_dim, theta, max_len):
    """cos/sin of HF's default rotary embedding, one row per position."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                                / head_dim))
    freqs = np.outer(np.arange(max_len, dtype=np.float32), inv_freq)
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rotary(x, cos, sin):
    """x: (tokens, heads, head_dim); cos/sin: (tokens, 1, head_dim)."""
    half = x.shape[-1] // 2
    rotated = ops.concat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def rms_norm(x, weight, eps):
    xf = x.astype(ms.float32)
    variance = ops.mean(xf * xf, -1, keep_dims=True)
    return weight * (xf * ops.rsqrt(variance + eps)).astype(x.dtype)


class DecoderLayer(nn.Cell):
    def __init__(self, ctx):
        super().__init__()
        config, plan = ctx.config, ctx.plan
        p = "model.layers.0."
        self.qkv_proj = ParallelLinear(ctx, p + "self_attn.qkv_proj", bias=True)
        self.o_proj = ParallelLinear(ctx, p + "self_attn.o_proj")
        self.gate_up_proj = ParallelLinear(ctx, p + "mlp.gate_up_proj")
        self.down_proj = ParallelLinear(ctx, p + "mlp.down_proj")
        self.eps = config.rms_norm_eps
        self.head_dim = config.head_dim
        if ctx.mode == "explicit":  # this rank's slices
            self.heads, self.kv_heads = plan.local_heads, plan.local_kv_heads
            self.intermediate = plan.local_shape(p + "mlp.down_proj.weight")[1]
        else:  # full shapes, laid out by MindSpore
            self.heads, self.kv_heads = config.num_heads, config.num_kv_heads
            self.intermediate = config.intermediate_size
        self.groups = self.heads // self.kv_heads
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.write_rows = ops.ScatterUpdate()

    def construct(self, x, cos, sin, k_cache, v_cache, write_rows, context_rows, mask,
                  ln1, w_qkv, b_qkv, w_o, ln2, w_gate_up, w_down):
        """x: (N, hidden) with N = G*Q tokens; cos/sin: (N, 1, head_dim); write_rows: (N,)
        cache rows of the tokens' own K/V; context_rows: (G*T,); mask: (G, Q, T), 0 where a
        query may look and a large negative number elsewhere."""
        h = rms_norm(x, ln1, self.eps)
        qkv = self.qkv_proj(h, w_qkv, b_qkv)
        tokens = x.shape[0]
        q = qkv[:, :self.q_size].reshape(tokens, self.heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(tokens, self.kv_heads,
                                                                   self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].reshape(tokens, self.kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        # Write this call's K/V, then read the context (which includes them) after the writes.
        k_written = self.write_rows(k_cache, write_rows, k)
        v_written = self.write_rows(v_cache, write_rows, v)
        keys = ops.gather(ops.depend(k_cache, k_written), context_rows, 0)
        values = ops.gather(ops.depend(v_cache, v_written), context_rows, 0)
        x = x + self.o_proj(self._attend(q, keys, values, mask), w_o)
        h = rms_norm(x, ln2, self.eps)
        gate_up = self.gate_up_proj(h, w_gate_up)
        act = ops.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
        return x + self.down_proj(act, w_down)

    def _attend(self, q, keys, values, mask):
        groups, queries, context = mask.shape
        d, kv = self.head_dim, self.kv_heads
        keys = keys.reshape(groups, context, kv, d).transpose(0, 2, 1, 3)
        values = values.reshape(groups, context, kv, d).transpose(0, 2, 1, 3)
        # Query head j uses KV head j // groups: put each KV head's queries in one row block.
        q = q.reshape(groups, queries, kv, self.groups, d).transpose(0, 2, 3, 1, 4)
        q = q.reshape(groups, kv, self.groups * queries, d)
        # The scores are the big tensor here: scale q, not them; softmax in float32.
        scores = ops.BatchMatMul(transpose_b=True)(q * self.scale, keys)
        if scores.dtype != ms.float32:
            scores = scores.astype(ms.float32)
        mask = ops.tile(mask, (1, self.groups, 1)).reshape(groups, 1, self.groups * queries,
                                                          context)
        probs = ops.softmax(scores + mask, -1)
        if probs.dtype != values.dtype:
            probs = probs.astype(values.dtype)
        out = ops.BatchMatMul()(probs, values)  # (G, kv, groups*Q, d)
        out = out.reshape(groups, kv, self.groups, queries, d).transpose(0, 3, 1, 2, 4)
        return out.reshape(groups * queries, self.heads * d)


class Embedding(nn.Cell):
    def __init__(self, ctx):
        super().__init__()
        self.embed = ParallelEmbedding(ctx, "model.embed_tokens")

    def construct(self, ids, weight):
        return self.embed(ids, weight)


class LMHead(nn.Cell):
    """Final norm and lm_head over the rows that need logits; float32 logits."""

    def __init__(self, ctx):
        super().__init__()
        self.eps = ctx.config.rms_norm_eps
        self.lm_head = ParallelLinear(ctx, "lm_head")

    def construct(self, x, rows, norm_weight, lm_weight):
        x = ops.gather(x, rows, 0)
        return self.lm_head(rms_norm(x, norm_weight, self.eps), lm_weight).astype(ms.float32)


def new_cache(layout, dtype, name):
    """One of the two cache tensors (K or V) as a Parameter updated in place."""
    return Parameter(Tensor(shape=layout.shape, dtype=dtype, init=Zero()), name=name,
                     requires_grad=False)


class Qwen2Model(nn.Cell):
    """The whole model in one graph, owning its weights as Parameters (semi_auto mode).

    construct(ids, cos, sin, write_slots, context_slots, mask, logit_rows) -> float32 logits
    of the rows `logit_rows`; the slots are layer-0 cache rows, offset here per layer."""

    def __init__(self, ctx, layout, shapes):
        super().__init__()
        config = ctx.config
        self.embedding = Embedding(ctx)
        self.layer = DecoderLayer(ctx)
        self.head = LMHead(ctx)
        self.num_slots = layout.num_slots

        def param(name):
            return Parameter(Tensor(shape=shapes[name], dtype=ctx.dtype, init=Zero()),
                             name=name, requires_grad=False)

        self.embed_weight = param("model.embed_tokens.weight")
        self.weights = {"model.embed_tokens.weight": self.embed_weight}
        holders = []
        for n in range(config.num_layers):
            params = ms.ParameterTuple([param(name) for name in layer_weight_names(n)])
            setattr(self, f"layer{n}_weights", params)  # registered with the Cell
            self.weights.update({p.name: p for p in params})
            holders.append(params)
        self.layer_params = tuple(holders)
        norm_name, lm_name = head_weight_names(config)
        self.norm_weight = param(norm_name)
        self.weights[norm_name] = self.norm_weight
        self.lm_weight = (self.embed_weight if config.tie_word_embeddings else param(lm_name))
        self.weights[lm_name] = self.lm_weight
        self.k_cache = new_cache(layout, ctx.dtype, "k_cache")
        self.v_cache = new_cache(layout, ctx.dtype, "v_cache")

    def construct(self, ids, cos, sin, write_slots, context_slots, mask, logit_rows):
        x = self.embedding(ids, self.embed_weight)
        for n, weights in enumerate(self.layer_params):
            offset = n * self.num_slots
            x = self.layer(x, cos, sin, self.k_cache, self.v_cache, write_slots + offset,
                           context_slots + offset, mask, *weights)
        return self.head(x, logit_rows, self.norm_weight, self.lm_weight)
