"""msModelSlim's quantized checkpoints: detected, read and checked before any rank starts.

A directory msModelSlim wrote has `quant_model_description.json` (v0's `safe_tensor` saver:
`quant_model_description_<type>.json`) naming each tensor's scheme ("W8A8", "FLOAT", ...),
and its weights in `quant_model_weight_<type>*.safetensors` (v0) or
`quant_model_weights-*.safetensors` (v1), one file or several with an `.index.json`.

`describe(model_dir, config)` returns None for a float checkpoint, else a `Quantization`: the
scheme of each of a layer's fused projections (the same in every layer: one compiled graph
serves them all), after checking every tensor the schemes take exists with its dtype and
shape. What msinfer cannot run is refused here, naming the file, the tensor and the scheme.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os

from .errors import MsinferError

# The checkpoint suffixes each scheme's linear takes besides its float bias, with the dtypes
# (safetensors names) and shapes (N: output rows, K: inputs, G: weight-scale groups) allowed.
_FLOATS = ("F16", "F32", "BF16")
TENSORS = {
    "W8A8": {"weight": (("I8",), "NK"), "deq_scale": (("I64", "F32"), "N"),
             "quant_bias": (("I32",), "N"), "input_scale": (_FLOATS, "1"),
             "input_offset": (_FLOATS, "1")},
    "W8A8_DYNAMIC": {"weight": (("I8",), "NK"), "weight_scale": (_FLOATS, "N1")},
    "W8A16": {"weight": (("I8",), "NK"), "weight_scale": (_FLOATS, "NG"),
              "weight_offset": (_FLOATS, "NG")},
}
ALIASES = {"W8A8S": "W8A8"}  # sparse-friendly W8A8: the same tensors and formula
REFUSED = {
    "W8A8SC": "compressed weights, decompressed by the Ascend device's compression unit at "
              "load (index/info tensors), for one tensor-parallel size",
    "W16A16SC": "compressed float weights, decompressed by the Ascend device at load",
    "W4A16": "int4 weights (Atlas A2/A3 only)", "W4A8": "int4 weights (Atlas A2/A3 only)",
    "W4A8_DYNAMIC": "int4 weights (Atlas A2/A3 only)",
}
WORKS = ("what loads: W8A8, W8A8S (as W8A8), W8A8_DYNAMIC and W8A16 (per channel or "
         "group-wise), or the float checkpoint; quantize again with msModelSlim to one of "
         "those (docs/quantization.md)")
# A decoder layer's projections, as the model fuses them.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A checked msModelSlim checkpoint: its type and each fused projection's scheme."""

    model_quant_type: str
    description: str  # path of the description file
    layout: str  # "v0" or "v1" file names
    schemes: tuple  # ((fused module, scheme), ...), scheme a TENSORS key or "FLOAT"

    def scheme_of(self, module: str) -> str:
        """The scheme of `module` (e.g. "self_attn.qkv_proj"), FLOAT for any other."""
        return dict(self.schemes).get(module, "FLOAT")


def find_description(model_dir):
    names = sorted(glob.glob(os.path.join(model_dir, "quant_model_description*.json")))
    return names[0] if names else None


def weight_files(model_dir):
    """{tensor: file} of a quantized directory's safetensors (index or headers); layout."""
    for layout, pattern in (("v1", "quant_model_weights*"), ("v0", "quant_model_weight_*")):
        indexes = glob.glob(os.path.join(model_dir, pattern + ".index.json"))
        if indexes:
            with open(indexes[0]) as f:
                return dict(json.load(f)["weight_map"]), layout
        files = sorted(glob.glob(os.path.join(model_dir, pattern + ".safetensors")))
        if files:
            from safetensors import safe_open
            file_of = {}
            for path in files:
                with safe_open(path, framework="numpy") as f:
                    file_of.update({k: os.path.basename(path) for k in f.keys()})
            return file_of, layout
    raise MsinferError(f"{model_dir}: has a quant_model_description but no "
                       f"quant_model_weight_*.safetensors or quant_model_weights-*.safetensors")


def describe(model_dir, config, want=None):
    """The checked Quantization of `model_dir`, None for a float checkpoint. `want`: None
    (detect), "msmodelslim" (the directory must be quantized) or "none" (it must not)."""
    path = find_description(model_dir)
    if path is None:
        if want == "msmodelslim":
            raise MsinferError(f"{model_dir}: --quantization msmodelslim, but the directory has "
                               f"no quant_model_description.json (not an msModelSlim output)")
        return None
    if want == "none":
        raise MsinferError(f"{path}: the checkpoint is quantized (msModelSlim) and "
                           f"--quantization none asks for float weights; drop the flag")
    from .config import read_json_object  # config's presets import this module
    description = read_json_object(path)
    quant_type = str(description.get("model_quant_type", "?"))
    file_of, layout = weight_files(model_dir)
    schemes = {m: _scheme(path, description, config, m) for m in FUSED}
    _check_tensors(model_dir, path, file_of, config, schemes)
    return Quantization(quant_type, path, layout,
                        tuple((m, s) for m, s in schemes.items()))


def _scheme(path, description, config, module):
    """The one scheme of `module`'s parts in every layer."""
    found = {}
    for layer in range(config.num_layers):
        for part in FUSED[module]:
            name = f"model.layers.{layer}.{part}.weight"
            scheme = str(description.get(name, "FLOAT")).upper()
            scheme = ALIASES.get(scheme, scheme)
            if scheme in REFUSED:
                raise MsinferError(
                    f"{path}: {name} is {scheme}: {REFUSED[scheme]}; msinfer cannot run it. "
                    f"{WORKS}")
            if scheme != "FLOAT" and scheme not in TENSORS:
                raise MsinferError(f"{path}: {name} has scheme {scheme!r}, which msinfer does "
                                   f"not know. {WORKS}")
            found.setdefault(scheme, name)
    if len(found) > 1:
        mixed = ", ".join(f"{name}: {scheme}" for scheme, name in found.items())
        raise MsinferError(
            f"{path}: {module} mixes schemes across layers or parts ({mixed}); "
            f"msinfer compiles one graph for every layer, so each projection needs one scheme "
            f"in all layers. {WORKS}")
    return next(iter(found))


def _check_tensors(model_dir, path, file_of, config, schemes):
    """Every tensor the schemes take is in the files, of an allowed dtype and shape."""
    from safetensors import safe_open
    shapes = config.parameter_shapes()
    handles = {}
    try:
        for module, scheme in schemes.items():
            for layer in range(config.num_layers):
                for part in FUSED[module]:
                    prefix = f"model.layers.{layer}.{part}"
                    n, k = shapes[prefix + ".weight"]
                    for suffix, (dtypes, dims) in TENSORS.get(scheme, {}).items():
                        name = f"{prefix}.{suffix}"
                        if name not in file_of:
                            raise MsinferError(
                                f"{path}: {prefix}.weight is {scheme}, which takes {name}; no "
                                f"quant_model_weight*.safetensors file of {model_dir} has it")
                        file = file_of[name]
                        if file not in handles:
                            handles[file] = safe_open(os.path.join(model_dir, file),
                                                      framework="numpy")
                        info = handles[file].get_slice(name)
                        _check_one(os.path.join(model_dir, file), name, scheme, info, dtypes,
                                   dims, n, k)
    finally:
        handles.clear()


def _check_one(file, name, scheme, info, dtypes, dims, n, k):
    dtype, shape = info.get_dtype(), tuple(info.get_shape())
    if dtype not in dtypes:
        raise MsinferError(f"{file}: {name} ({scheme}) is {dtype}; {scheme} takes "
                           f"{' or '.join(dtypes)}")
    expected = {"NK": (n, k), "N": (n,), "1": (1,), "N1": (n, 1)}.get(dims)
    if dims == "NG":
        ok = len(shape) == 2 and shape[0] == n and shape[1] > 0 and k % shape[1] == 0
        want = f"[{n}, groups] with groups dividing {k}"
    else:
        ok = shape == expected or (dims == "1" and shape == ())
        want = list(expected)
    if not ok:
        raise MsinferError(f"{file}: {name} ({scheme}) has shape {list(shape)}, expected "
                           f"{want} from config.json")


def preset(scheme):
    """A Quantization for a preset model (planning without the checkpoint): every decoder
    projection in `scheme`, per channel."""
    return Quantization(scheme, "<preset>", "preset", tuple((m, scheme) for m in FUSED))


def stored_bytes(quantization, name, rows, cols, dtype_bytes):
    """Bytes a rank holds for checkpoint tensor `name` of its (rows, cols) slice: int8
    weights and their per-row scales for a quantized projection (models/quant_loader.py:
    deq_scale float32 and quant_bias int32; weight scale and offset in the compute dtype),
    else rows x cols x dtype_bytes."""
    elements = rows * cols
    if quantization is None or not (name.startswith("model.layers.")
                                    and name.endswith(".weight")):
        return elements * dtype_bytes
    module = name.split(".", 3)[3].rsplit(".", 1)[0]
    fused = next((f for f, parts in FUSED.items() if module in parts), None)
    scheme = quantization.scheme_of(fused) if fused else "FLOAT"
    per_row = {"FLOAT": None, "W8A8": 4 + 4, "W8A8_DYNAMIC": dtype_bytes,
               "W8A16": 2 * dtype_bytes}[scheme]
    if per_row is None:
        return elements * dtype_bytes
    return elements + rows * per_row
