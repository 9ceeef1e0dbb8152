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

from . import log
from .errors import MsinferError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class Checkpoint:
    """Where each tensor of a checkpoint directory lives."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
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

    def load_into(self, parameters, slices_of):
        """Fill `parameters` ({name: Parameter}) with the slices `slices_of(name)` selects,
        converted to each parameter's dtype. Checks every tensor's full shape against the parameter's
        expected one before reading."""
        missing = sorted(set(parameters) - set(self.file_of))
        if missing:
            raise MsinferError(
                f"{self.model_dir}: checkpoint lacks {len(missing)} tensor(s) the model needs, "
                f"first: {missing[0]}")
        by_file = {}
        for name in parameters:
            by_file.setdefault(self.file_of[name], []).append(name)
        progress = log.Progress("loading weights", len(parameters))
        done = 0
        for file in sorted(by_file):
            with self._open(file) as f:
                for name in by_file[file]:
                    param = parameters[name]
                    slices, full_shape = slices_of(name)
                    tensor = f.get_slice(name)
                    found = tuple(tensor.get_shape())
                    if found != tuple(full_shape):
                        raise MsinferError(
                            f"{os.path.join(self.model_dir, file)}: tensor {name} has shape "
                            f"{list(found)}, expected {list(full_shape)} from config.json")
                    try:
                        data = tensor[slices]
                    except SafetensorError as e:
                        raise MsinferError(f"{os.path.join(self.model_dir, file)}: cannot read "
                                           f"{name} ({e}); is the file truncated?") from None
                    param.set_data(to_parameter_data(data, param))
                    done += 1
                    progress.step(done, file)


def to_parameter_data(array, param):
    import mindspore as ms
    # bfloat16 goes through float32: MindSpore takes no ml_dtypes arrays.
    host_dtype = {ms.float32: np.float32, ms.float16: np.float16}.get(param.dtype, np.float32)
    if array.dtype != host_dtype:
        array = array.astype(np.float32).astype(host_dtype)
    return ms.Tensor(np.ascontiguousarray(array), dtype=param.dtype)
