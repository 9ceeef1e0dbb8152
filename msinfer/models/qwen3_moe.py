"""Qwen3-MoE for causal LM (HF's `modeling_qwen3_moe.py`; Qwen3-30B-A3B): Qwen3's attention
(q/k norms, no q/k/v bias) with, in its sparse layers, routed experts in place of the MLP
(layers/moe.py: softmax over the experts, top num_experts_per_tok, renormalised when
norm_topk_prob). Layers in mlp_only_layers, or off the decoder_sparse_step, keep Qwen3's
dense MLP. No shared expert.
"""
from . import moe_family, qwen2, qwen3
from .qwen2 import EMBEDDING_WEIGHT, Embedding, LMHead, head_weight_names  # noqa: F401

weight_layout = moe_family.weight_layout


class DenseLayer(qwen3.DecoderLayer):
    def _make_mlp(self, ctx):
        return moe_family.dense_mlp(ctx)


class SparseLayer(qwen3.DecoderLayer):
    WEIGHTS = qwen3.LAYER_WEIGHTS[:-2] + moe_family.SPARSE_MLP_WEIGHTS

    def _make_mlp(self, ctx):
        return moe_family.sparse_mlp(ctx)

    def construct(self, x, cos, sin, k_cache, v_cache, write_rows, context_rows, mask,
                  ln1, w_qkv, w_q_norm, w_k_norm, w_o, ln2, w_router, w_gate_up, w_down):
        """As Qwen3's layer, with the router's and the stacked experts' weights in place of
        the MLP's."""
        q, k, v = self._normed_qkv(x, ln1, w_qkv, w_q_norm, w_k_norm)
        x = self._attend(x, q, k, v, cos, sin, k_cache, v_cache, write_rows, context_rows,
                         mask, w_o)
        return self._residual_mlp(x, ln2, w_router, w_gate_up, w_down)


def layer_classes(config) -> tuple:
    return moe_family.layer_classes(config, DenseLayer, SparseLayer)


def weight_names(config) -> list:
    return moe_family.weight_names(config, layer_classes(config))


class LayerStack(qwen2.LayerStack):
    LAYER = SparseLayer


Model = None  # no semi_auto model: strategy.resolve runs MoE models in explicit mode only
