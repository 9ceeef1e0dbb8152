"""Qwen2-MoE for causal LM (HF's `modeling_qwen2_moe.py`; Qwen2-57B-A14B): Qwen2's attention
(q/k/v biases) with, in its sparse layers, routed experts (layers/moe.py) plus a shared
expert whose output is scaled per token by sigmoid(shared_expert_gate(x)). Layers in
mlp_only_layers, or off the decoder_sparse_step, keep Qwen2's dense MLP.
"""
from . import moe_family, qwen2
from .qwen2 import EMBEDDING_WEIGHT, Embedding, LMHead, head_weight_names  # noqa: F401

weight_layout = moe_family.weight_layout


class DenseLayer(qwen2.DecoderLayer):
    def _make_mlp(self, ctx):
        return moe_family.dense_mlp(ctx)


class SparseLayer(qwen2.DecoderLayer):
    WEIGHTS = (qwen2.LAYER_WEIGHTS[:-2] + moe_family.SPARSE_MLP_WEIGHTS
               + moe_family.SHARED_EXPERT_WEIGHTS)

    def _make_mlp(self, ctx):
        return moe_family.sparse_mlp(ctx)

    def construct(self, x, cos, sin, k_cache, v_cache, write_rows, context_rows, mask,
                  ln1, w_qkv, b_qkv, w_o, ln2, w_router, w_gate_up, w_down,
                  w_shared_gate_up, w_shared_down, w_shared_gate):
        """As Qwen2's layer, with the router's, the stacked experts' and the shared expert's
        weights in place of the MLP's."""
        q, k, v = self._qkv(x, ln1, w_qkv, b_qkv)
        x = self._attend(x, q, k, v, cos, sin, k_cache, v_cache, write_rows, context_rows,
                         mask, w_o)
        return self._residual_mlp(x, ln2, w_router, w_gate_up, w_down, w_shared_gate_up,
                                  w_shared_down, w_shared_gate)


def layer_classes(config) -> tuple:
    return moe_family.layer_classes(config, DenseLayer, SparseLayer)


def weight_names(config) -> list:
    return moe_family.weight_names(config, layer_classes(config))


class LayerStack(qwen2.LayerStack):
    LAYER = SparseLayer


Model = None  # no semi_auto model: strategy.resolve runs MoE models in explicit mode only
