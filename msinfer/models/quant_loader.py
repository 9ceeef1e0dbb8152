"""This rank's slices of an msModelSlim checkpoint (quantization.py checked it).

Float tensors (embeddings, norms, lm_head, q/k/v biases) load as a float checkpoint's do. A
quantized projection loads as the tuple its linear method takes (layers/linear_methods.py),
its int8 weight kept int8, each tensor cut by the shard plan's split of its weight:
- colwise (by output rows): weight, deq_scale, quant_bias and weight scales/offsets by row;
- rowwise (by input columns): weight by column, group-wise scales by group, per-channel
  scales whole, quant_bias on tensor rank 0 only in explicit mode (zeros elsewhere: the
  AllReduce that sums the ranks' partial products adds it exactly once; semi_auto adds it
  after MindSpore's sum, on every rank); activation scales whole everywhere.
A fused projection (q/k/v, gate/up) stacks its parts' rows; its parts see the same input, so
their activation scale and offset must agree.
"""
import os

import numpy as np

from ..errors import MsinferError
from ..layers.linear_methods import tensor_suffixes
from ..parallel.strategy import checkpoint_parts
from ..quantization import weight_files
from .loader import Checkpoint

PER_TENSOR = ("input_scale", "input_offset")


def quantized_rank_weights(model_dir, plan, tensor_rank, names, dtype, tables=(),
                           table_dtype=None, bias_on_rank_0=True):
    """Yields (name, array) for each float weight in `names` and (name, tuple of arrays) for
    each quantized projection's, as rank_weights does for a float checkpoint; the float
    weights in `tables` (the embedding, the lm_head) in `table_dtype` where it is given.
    `bias_on_rank_0`: a row-parallel quant_bias on tensor rank 0 only (explicit mode)."""
    config = plan.config
    file_of, _ = weight_files(model_dir)
    checkpoint = Checkpoint(model_dir, file_of)
    shapes = config.parameter_shapes()
    quantized = [n for n in names if _scheme(config, n) != "FLOAT"]
    floats = [n for n in names if n not in quantized]
    tables = [n for n in floats if n in tables] if table_dtype is not None else []

    def parts_of(name):
        return [(part, plan.slices(part, tensor_rank), shapes[part])
                for part in checkpoint_parts(name)]

    yield from checkpoint.load(tables, parts_of, table_dtype)
    yield from checkpoint.load([n for n in floats if n not in tables], parts_of, dtype)
    for name in quantized:
        scheme = _scheme(config, name)
        yield name, tuple(_stacked(checkpoint, plan, tensor_rank, name, suffix, dtype,
                                   bias_on_rank_0) for suffix in tensor_suffixes(scheme))


def _scheme(config, name):
    """The scheme of weight `name` in its own layer ("FLOAT" for a bias, a norm, ...)."""
    if not name.endswith(".weight"):
        return "FLOAT"
    return config.quantization.scheme_at(name)


def _stacked(checkpoint, plan, tensor_rank, name, suffix, dtype, bias_on_rank_0):
    """`suffix`'s tensor of fused weight `name` on this rank: its parts' slices stacked."""
    blocks = []
    for part in checkpoint_parts(name):
        tensor = part[:-len("weight")] + suffix
        rows, cols = plan.slices(part, tensor_rank)
        rowwise = plan.style(part) == "rowwise" and plan.tensor > 1
        with checkpoint._open(checkpoint.file_of[tensor]) as handle:
            whole = handle.get_slice(tensor)
            if suffix == "weight":
                block = whole[rows, cols]
            elif suffix in PER_TENSOR:
                block = whole[:].reshape(1)
            elif suffix in ("weight_scale", "weight_offset"):
                groups = whole.get_shape()[1]
                size = (cols.stop - cols.start) * groups // plan.config.parameter_shapes()[part][1]
                first = cols.start * groups // plan.config.parameter_shapes()[part][1]
                block = whole[rows, first:first + size] if rowwise and groups > 1 else \
                    whole[rows, :]
            else:  # deq_scale, quant_bias: one per output row
                block = whole[rows]
        if suffix == "quant_bias" and rowwise and tensor_rank > 0 and bias_on_rank_0:
            block = np.zeros_like(block)
        blocks.append(_converted(block, suffix, dtype))
    if suffix in PER_TENSOR:
        if any(not np.array_equal(b, blocks[0]) for b in blocks[1:]):
            raise MsinferError(
                f"{os.path.join(checkpoint.model_dir, checkpoint.file_of[tensor])}: the parts "
                f"of {name} ({', '.join(checkpoint_parts(name))}) have different {suffix}s; "
                f"msinfer runs them as one fused matmul on one quantized input")
        return blocks[0]
    return np.ascontiguousarray(np.concatenate(blocks)) if len(blocks) > 1 else \
        np.ascontiguousarray(blocks[0])


def _converted(block, suffix, dtype):
    if suffix == "weight":
        return block  # int8
    if suffix == "quant_bias":
        return block.astype(np.int32)
    if suffix == "deq_scale":
        if block.dtype == np.int64:  # float32 bits in an int64 (fp16 sources)
            return block.astype(np.int32).view(np.float32)
        return block.astype(np.float32)
    return block.astype(np.float32).astype(dtype)
