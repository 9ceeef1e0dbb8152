"""Qwen3 dense for causal LM: Qwen2's model (models/qwen2.py) with the attention of HF's
`modeling_qwen3.py`. What differs is one step of the decoder layer: q/k/v have no bias, and q
and k are each normed per head (RMSNorm over head_dim, `self_attn.q_norm` / `k_norm`, one
weight of head_dim shared by every head and held whole by every tensor rank) before the
rotary embedding. head_dim comes from the config (128 in every released Qwen3, whatever
hidden / heads). Embedding, MLP, head, the paged cache and both parallel modes are Qwen2's.
"""
from ..layers.norm import RMSNorm
from . import qwen2
from .qwen2 import (EMBEDDING_WEIGHT, Embedding, LMHead, head_weight_names,  # noqa: F401
                    weight_layout)

# One decoder layer's weights, in the order DecoderLayer takes them.
LAYER_WEIGHTS = ("input_layernorm.weight", "self_attn.qkv_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def layer_weight_names(layer: int) -> list:
    return [f"model.layers.{layer}.{w}" for w in LAYER_WEIGHTS]


def layer_classes(config) -> tuple:
    return (DecoderLayer,) * config.num_layers


def weight_names(config) -> list:
    """Every weight the model takes, each once, in load order."""
    return qwen2.weight_names(config, layer_weight_names)


class DecoderLayer(qwen2.DecoderLayer):
    WEIGHTS = LAYER_WEIGHTS
    QKV_BIAS = False

    def __init__(self, ctx, layer=0):
        super().__init__(ctx, layer)
        self.q_norm = RMSNorm(ctx, per_head=True)
        self.k_norm = RMSNorm(ctx, per_head=True)

    def construct(self, x, cos, sin, k_cache, v_cache, write_rows, context_rows, mask,
                  ln1, w_qkv, w_q_norm, w_k_norm, w_o, ln2, w_gate_up, w_down):
        """As Qwen2's DecoderLayer.construct, with the q/k norms' weights in place of the
        q/k/v bias."""
        q, k, v = self._normed_qkv(x, ln1, w_qkv, w_q_norm, w_k_norm)
        x = self._attend(x, q, k, v, cos, sin, k_cache, v_cache, write_rows, context_rows,
                         mask, w_o)
        return self._residual_mlp(x, ln2, w_gate_up, w_down)

    def _normed_qkv(self, x, ln1, w_qkv, w_q_norm, w_k_norm):
        q, k, v = self._qkv(x, ln1, w_qkv, None)
        return self.q_norm(q, w_q_norm), self.k_norm(k, w_k_norm), v


class LayerStack(qwen2.LayerStack):
    LAYER = DecoderLayer


class Qwen3Model(qwen2.Qwen2Model):
    """The whole model in one graph (semi_auto mode), as Qwen2Model."""

    LAYER = DecoderLayer


Model = Qwen3Model
