"""The model family of a config: the module (one per family) whose Cells and weight names the
model runner builds the model from. Each family module has the same names: EMBEDDING_WEIGHT,
Embedding, LayerStack, LMHead, Model (the whole-model Cell of semi_auto; None for the MoE
families, which run in explicit mode only), head_weight_names, weight_names, weight_layout,
layer_classes (the decoder-layer class of each layer, whose WEIGHTS name its weights); the
dense families also layer_weight_names."""
from ..errors import MsinferError
from . import qwen2, qwen2_moe, qwen3, qwen3_moe

FAMILIES = {"qwen2": qwen2, "qwen3": qwen3, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe}


def family_of(config):
    """The family module of `config.model_type` (config.py refuses the others first)."""
    try:
        return FAMILIES[config.model_type]
    except KeyError:
        raise MsinferError(f"{config.source}: model_type {config.model_type!r} has no model "
                           f"code (msinfer runs {', '.join(FAMILIES)})") from None
