"""Qwen2 for causal LM as MindSpore Cells, with a static KV cache held in Parameters.

The model reads top to bottom like Hugging Face's `modeling_qwen2.py`: embedding, decoder
layers (RMSNorm, rotary attention with grouped KV heads and q/k/v biases, SwiGLU MLP), final
norm, lm_head (tied to the embedding when the config says so). Sharding lives in
`parallel_layers`: this file never mentions ranks, except through the head counts it reads off
its (possibly sharded) projections.

Two entry points, each compiled as its own graph by `PrefillStep` / `DecodeStep`:
- `prefill(ids[B,S], last_index[B,2], cache_rows[B*kv*S], mask[S,S])`: runs whole prompts
  (right-padded to a bucket length S), writes their K/V into cache rows 0..B-1, positions
  0..S-1, and returns the logits at each prompt's last real token.
- `decode(ids[B], positions[B], cache_rows[B*kv], context_rows[B*kv*T], mask[B,T])`: one
  token per row at its own position, attending over the first T cache positions of its row
  (T is a bucket >= the longest row), gathered by row number: a step reads only its context.
Padding needs no special case: a row's padded positions are written to the cache but masked
out of every later step, and overwritten as the row grows.
"""
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
import mindspore as ms

from .parallel_layers import ParallelEmbedding, ParallelLinear


def rotary_tables(head_dim, theta, max_len):
    """cos/sin of HF's default rotary embedding, one row per position."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                                / head_dim))
    freqs = np.outer(np.arange(max_len, dtype=np.float32), inv_freq)
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rotary(x, cos, sin):
    """x: (B, S, heads, head_dim); cos/sin broadcast to it."""
    half = x.shape[-1] // 2
    rotated = ops.concat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


class RMSNorm(nn.Cell):
    def __init__(self, ctx, name, eps):
        super().__init__()
        self.weight = ctx.new_parameter(name + ".weight")
        self.checkpoint_names = {name + ".weight": self.weight}
        self.eps = eps

    def construct(self, x):
        xf = x.astype(ms.float32)
        variance = ops.mean(xf * xf, -1, keep_dims=True)
        return self.weight * (xf * ops.rsqrt(variance + self.eps)).astype(x.dtype)


class Attention(nn.Cell):
    def __init__(self, ctx, prefix, config, max_batch, max_len):
        super().__init__()
        p = prefix + "self_attn."
        self.q_proj = ParallelLinear(ctx, p + "q_proj", bias=True)
        self.k_proj = ParallelLinear(ctx, p + "k_proj", bias=True)
        self.v_proj = ParallelLinear(ctx, p + "v_proj", bias=True)
        self.o_proj = ParallelLinear(ctx, p + "o_proj")
        self.head_dim = config.head_dim
        self.heads = ctx.parameter_shape(p + "q_proj.weight")[0] // self.head_dim
        self.kv_heads = ctx.parameter_shape(p + "k_proj.weight")[0] // self.head_dim
        self.groups = self.heads // self.kv_heads
        self.scale = self.head_dim ** -0.5
        # The cache is (batch, kv head, position, head_dim) flattened to one row per vector,
        # row (b * kv + h) * max_len + position: ScatterUpdate writes rows in place, where a
        # scatter into the 4-D tensor would copy the whole cache at every step.
        rows = (max_batch * self.kv_heads * max_len, self.head_dim)
        host_dtype = np.float16 if ctx.dtype == ms.float16 else np.float32  # no numpy bf16
        self.k_cache = Parameter(Tensor(np.zeros(rows, host_dtype), ctx.dtype),
                                 name=prefix + "k_cache", requires_grad=False)
        self.v_cache = Parameter(Tensor(np.zeros(rows, host_dtype), ctx.dtype),
                                 name=prefix + "v_cache", requires_grad=False)
        self.write_rows = ops.ScatterUpdate()

    def _project(self, x, batch, seq, cos, sin):
        q = self.q_proj(x).reshape(batch, seq, self.heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, seq, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, seq, self.kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _attend(self, q, k, v, mask):
        """q: (B, kv, rows, D) with rows = groups*queries; k, v: (B, kv, T, D)."""
        # The scores are the big tensors here (rows x T): scale q instead, and cast only
        # where the compute dtype is not float32 already (decided when the graph compiles).
        scores = ops.BatchMatMul(transpose_b=True)(q * self.scale, k)
        if scores.dtype != ms.float32:
            scores = scores.astype(ms.float32)
        probs = ops.softmax(scores + mask, -1)
        if probs.dtype != v.dtype:
            probs = probs.astype(v.dtype)
        return ops.BatchMatMul()(probs, v)

    def _write_cache(self, cache_rows, k, v):
        """Writes k, v (rows ordered like cache_rows); returns the caches, to be read after
        the writes (`depend` orders them; reshaping the whole Parameter would copy it)."""
        k_written = self.write_rows(self.k_cache, cache_rows, k.reshape(-1, self.head_dim))
        v_written = self.write_rows(self.v_cache, cache_rows, v.reshape(-1, self.head_dim))
        return ops.depend(self.k_cache, k_written), ops.depend(self.v_cache, v_written)

    def prefill(self, x, batch, seq, cos, sin, mask, cache_rows):
        q, k, v = self._project(x, batch, seq, cos, sin)
        k = k.transpose(0, 2, 1, 3)  # (B, kv, S, D): the cache's order
        v = v.transpose(0, 2, 1, 3)
        self._write_cache(cache_rows, k, v)
        # Query head j uses KV head j // groups: group the queries under their KV head.
        q = q.reshape(batch, seq, self.kv_heads, self.groups, self.head_dim)
        q = q.transpose(0, 2, 3, 1, 4).reshape(batch, self.kv_heads, self.groups * seq,
                                                self.head_dim)
        mask = ops.tile(mask, (self.groups, 1))  # (groups*S, S), rows ordered like q
        out = self._attend(q, k, v, mask)
        out = out.reshape(batch, self.kv_heads, self.groups, seq, self.head_dim)
        out = out.transpose(0, 3, 1, 2, 4).reshape(batch * seq, self.heads * self.head_dim)
        return self.o_proj(out)

    def decode(self, x, batch, cos, sin, mask, cache_rows, context_rows):
        q, k, v = self._project(x, batch, 1, cos, sin)
        keys, values = self._write_cache(cache_rows, k, v)
        context = mask.shape[-1]
        shape = (batch, self.kv_heads, context, self.head_dim)
        keys = ops.gather(keys, context_rows, 0).reshape(shape)
        values = ops.gather(values, context_rows, 0).reshape(shape)
        q = q.reshape(batch, self.kv_heads, self.groups, self.head_dim)
        out = self._attend(q, keys, values, mask.reshape(batch, 1, 1, context))
        return self.o_proj(out.reshape(batch, self.heads * self.head_dim))


class MLP(nn.Cell):
    def __init__(self, ctx, prefix):
        super().__init__()
        self.gate_proj = ParallelLinear(ctx, prefix + "mlp.gate_proj")
        self.up_proj = ParallelLinear(ctx, prefix + "mlp.up_proj")
        self.down_proj = ParallelLinear(ctx, prefix + "mlp.down_proj")

    def construct(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Cell):
    def __init__(self, ctx, index, config, max_batch, max_len):
        super().__init__()
        prefix = f"model.layers.{index}."
        self.input_layernorm = RMSNorm(ctx, prefix + "input_layernorm", config.rms_norm_eps)
        self.self_attn = Attention(ctx, prefix, config, max_batch, max_len)
        self.post_attention_layernorm = RMSNorm(ctx, prefix + "post_attention_layernorm",
                                                config.rms_norm_eps)
        self.mlp = MLP(ctx, prefix)

    def prefill(self, x, batch, seq, cos, sin, mask, cache_rows):
        x = x + self.self_attn.prefill(self.input_layernorm(x), batch, seq, cos, sin, mask,
                                       cache_rows)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x, batch, cos, sin, mask, cache_rows, context_rows):
        x = x + self.self_attn.decode(self.input_layernorm(x), batch, cos, sin, mask,
                                      cache_rows, context_rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2ForCausalLM(nn.Cell):
    def __init__(self, config, ctx, max_batch, max_len):
        super().__init__()
        self.config = config
        self.max_batch = max_batch
        self.max_len = max_len
        self.embed_tokens = ParallelEmbedding(ctx, "model.embed_tokens")
        self.layers = nn.CellList([DecoderLayer(ctx, i, config, max_batch, max_len)
                                   for i in range(config.num_layers)])
        self.norm = RMSNorm(ctx, "model.norm", config.rms_norm_eps)
        tied = self.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = ParallelLinear(ctx, "lm_head", weight=tied)
        cos, sin = rotary_tables(config.head_dim, config.rope_theta, max_len)
        self.cos = Tensor(cos, ctx.dtype)
        self.sin = Tensor(sin, ctx.dtype)
        self.kv_heads = self.layers[0].self_attn.kv_heads

    def prefill(self, ids, last_index, cache_rows, mask):
        batch, seq = ids.shape
        x = self.embed_tokens(ids.reshape(-1))
        cos = self.cos[:seq].reshape(1, seq, 1, -1)
        sin = self.sin[:seq].reshape(1, seq, 1, -1)
        for layer in self.layers:
            x = layer.prefill(x, batch, seq, cos, sin, mask, cache_rows)
        x = ops.gather_nd(x.reshape(batch, seq, -1), last_index)
        return self.lm_head(self.norm(x)).astype(ms.float32)

    def decode(self, ids, positions, cache_rows, context_rows, mask):
        batch = ids.shape[0]
        x = self.embed_tokens(ids)
        cos = ops.gather(self.cos, positions, 0).reshape(batch, 1, 1, -1)
        sin = ops.gather(self.sin, positions, 0).reshape(batch, 1, 1, -1)
        for layer in self.layers:
            x = layer.decode(x, batch, cos, sin, mask, cache_rows, context_rows)
        return self.lm_head(self.norm(x)).astype(ms.float32)


class PrefillStep(nn.Cell):
    """The compiled prefill graph (one per (batch, prompt-length) bucket)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, ids, last_index, cache_rows, mask):
        return self.model.prefill(ids, last_index, cache_rows, mask)


class DecodeStep(nn.Cell):
    """The compiled decode graph (one per (batch, context-length) bucket)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, ids, positions, cache_rows, context_rows, mask):
        return self.model.decode(ids, positions, cache_rows, context_rows, mask)
