"""Hugging Face safetensors checkpoints: each rank reads only the slices it holds.

A checkpoint is `model.safetensors`, or several files listed by `model.safetensors.index.json`.
`get_slice` maps the file and copies only the requested block, so a rank of a tp4 job touches
about a quarter of each sharded tensor. bfloat16 tensors are read through ml_dtypes (numpy has
no bfloat16 of its own) and converted to the compute dtype on the way in.
"""
import json
import os

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" dtype that safetensors asks for)
import numpy as np
from safetensors import SafetensorError, safe_open

from .. import log
from ..errors import MsinferError
from ..parallel.strategy import checkpoint_parts

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class Checkpoint:
    """Where each tensor of a checkpoint directory lives."""

    def __init__(self, model_dir, file_of=None):
        """file_of: {tensor: file} where the directory's files are named otherwise
        (msModelSlim's, models/quant_loader.py)."""
        self.model_dir = model_dir
        if file_of is not None:
            self.file_of = file_of
            return
        index_path = os.path.join(model_dir, INDEX_FILE)
        single_path = os.path.join(model_dir, SINGLE_FILE)
        if os.path.isfile(index_path):
            self.file_of = self._read_index(index_path)
        elif os.path.isfile(single_path):
            self.file_of = {name: SINGLE_FILE for name in self._tensor_names(single_path)}
        else:
            raise MsinferError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")

    def _read_index(self, path):
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise MsinferError(f"{path}: not a safetensors index ({e})") from None
        for file in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(self.model_dir, file)):
                raise MsinferError(f"{path}: lists {file}, which does not exist")
        return dict(weight_map)

    def _open(self, file):
        path = os.path.join(self.model_dir, file)
        try:
            return safe_open(path, framework="numpy")
        except (SafetensorError, OSError) as e:
            raise MsinferError(f"{path}: cannot read safetensors file ({e}); "
                               "is it truncated or still downloading?") from None

    def _tensor_names(self, path):
        with self._open(os.path.basename(path)) as f:
            return list(f.keys())

    def load(self, names, parts_of, dtype):
        """Yields (name, numpy array) for each model weight in `names`, one at a time (so a
        caller that converts each keeps one tensor's copy alive, not the whole model's):
        `parts_of(name)` lists the (checkpoint tensor, slices, full shape) it is stacked from
        (rows, in order), each checked against its expected full shape before reading,
        converted to `dtype`."""
        parts = {name: parts_of(name) for name in names}
        needed = sorted({tensor for plan in parts.values() for tensor, _, _ in plan})
        missing = [t for t in needed if t not in self.file_of]
        if missing:
            raise MsinferError(
                f"{self.model_dir}: checkpoint lacks {len(missing)} tensor(s) the model needs, "
                f"first: {missing[0]}")
        progress = log.Progress("loading weights", len(names))
        for done, name in enumerate(names, 1):
            blocks = []
            for tensor_name, slices, full_shape in parts[name]:
                # A file is mapped only while one weight is read: the pages a mapping has
                # touched count in this process's resident memory until it is closed (held
                # for the whole load they doubled the peak: 4.46 GB for 2.0 GB of weights).
                file = self.file_of[tensor_name]
                with self._open(file) as handle:
                    blocks.append(self._read(handle, file, tensor_name, slices, full_shape,
                                             dtype))
            yield name, blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
            progress.step(done, self.file_of[parts[name][0][0]])

    def _read(self, handle, file, name, slices, full_shape, dtype):
        tensor = handle.get_slice(name)
        found = tuple(tensor.get_shape())
        path = os.path.join(self.model_dir, file)
        if found != tuple(full_shape):
            raise MsinferError(f"{path}: tensor {name} has shape {list(found)}, expected "
                               f"{list(full_shape)} from config.json")
        try:
            data = tensor[slices]
        except SafetensorError as e:
            raise MsinferError(f"{path}: cannot read {name} ({e}); is the file truncated?") \
                from None
        # bfloat16 goes through float32: numpy has no bfloat16 arithmetic of its own.
        if data.dtype != dtype:
            data = data.astype(np.float32).astype(dtype)
        return np.ascontiguousarray(data)


def rank_weights(model_dir, plan, tensor_rank, names, dtype):
    """Yields (name, numpy array) of tensor rank `tensor_rank`'s slice of each model weight in
    `names`, in `dtype`: a fused weight (qkv_proj, gate_up_proj; a sparse layer's experts)
    stacked from its checkpoint parts, each part cut as the shard plan says."""
    shapes = plan.config.parameter_shapes()

    def parts_of(name):
        return [(part, plan.slices(part, tensor_rank), shapes[part])
                for part in plan.parts(name, tensor_rank)]

    return Checkpoint(model_dir).load(names, parts_of, dtype)


def full_shapes(config, names):
    """The whole (unsliced) shape of each model weight in `names`, fused ones stacked."""
    shapes = config.parameter_shapes()
    result = {}
    for name in names:
        parts = checkpoint_parts(name)
        result[name] = ((sum(shapes[p][0] for p in parts),) + tuple(shapes[parts[0]][1:]))
    return result
