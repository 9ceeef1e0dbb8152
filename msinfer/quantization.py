"""msModelSlim's quantized checkpoints: detected, read and checked before any rank starts.

A directory msModelSlim wrote has `quant_model_description.json` (v0's `safe_tensor` saver:
`quant_model_description_<type>.json`) naming each tensor's scheme ("W8A8", "FLOAT", ...),
and its weights in `quant_model_weight_<type>*.safetensors` (v0) or
`quant_model_weights-*.safetensors` (v1), one file or several with an `.index.json`.

`describe(model_dir, config)` returns None for a float checkpoint, else a `Quantization`: the
scheme of each of a layer's fused projections, layer by layer (msModelSlim leaves layers out:
its `disable_names` keep e.g. some layers' down_proj FLOAT; the parts of one fused projection
share one scheme), after checking every tensor the schemes take exists with its dtype and
shape. What msinfer cannot run is refused here, naming the file, the tensor and the scheme.
Layers of one scheme signature share compiled graphs (ModelConfig.layer_kinds).
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
# The schemes msinfer runs on Ascend's quantized matmuls (layers/linear_methods.py
# ascend_kernels, W8A8S as W8A8): the ones semi_auto can lay out, as MindSpore shards only those
ASCEND_SCHEMES = ("W8A8", "W8A16")
# A projection left FLOAT (msModelSlim's disable_names): its float weight
FLOAT_TENSORS = {"weight": (_FLOATS, "NK")}
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
MODULES = tuple(FUSED)
# The part a fused projection's per-tensor values (W8A8's activation scale) are counted with
FIRST_PARTS = tuple(parts[0] for parts in FUSED.values())


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A checked msModelSlim checkpoint: its type and each layer's fused projections'
    schemes."""

    model_quant_type: str
    description: str  # path of the description file
    layout: str  # "v0" or "v1" file names
    # per decoder layer, its signature: the scheme of each FUSED module in FUSED's order, a
    # TENSORS key or "FLOAT"
    layer_schemes: tuple

    def scheme_of(self, module: str, layer: int) -> str:
        """The scheme of fused `module` (e.g. "self_attn.qkv_proj") in decoder layer
        `layer`."""
        return self.layer_schemes[layer][MODULES.index(module)]

    def scheme_at(self, name: str) -> str:
        """The scheme of a decoder layer's projection named as the model or the checkpoint
        names it ("model.layers.3.mlp.down_proj", its ".weight", a part such as
        "model.layers.3.self_attn.q_proj.weight"); FLOAT for any other tensor (biases,
        norms, embeddings, lm_head, a MoE's experts)."""
        if not name.startswith("model.layers."):
            return "FLOAT"
        layer, rest = name[len("model.layers."):].split(".", 1)
        module = rest[:-len(".weight")] if rest.endswith(".weight") else rest
        fused = next((f for f, parts in FUSED.items() if module == f or module in parts), None)
        return self.scheme_of(fused, int(layer)) if fused else "FLOAT"

    def by_module(self) -> dict:
        """{fused module: {scheme: [layers]}}, schemes in order of first use."""
        found = {m: {} for m in MODULES}
        for layer, signature in enumerate(self.layer_schemes):
            for module, scheme in zip(MODULES, signature):
                found[module].setdefault(scheme, []).append(layer)
        return found


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
    layer_schemes = tuple(tuple(_scheme(path, description, layer, m) for m in MODULES)
                          for layer in range(config.num_layers))
    quantization = Quantization(quant_type, path, layout, layer_schemes)
    _check_only_projections(path, description, quantization)
    _check_tensors(model_dir, path, file_of, config, layer_schemes)
    return quantization


def _check_only_projections(path, description, quantization):
    """No weight outside the decoder layers' projections is quantized: msinfer would read its
    int8 values as float weights."""
    for name, scheme in description.items():
        if (name.endswith(".weight") and str(scheme).upper() != "FLOAT"
                and quantization.scheme_at(name) == "FLOAT"):
            raise MsinferError(
                f"{path}: {name} is {scheme}; msinfer runs quantized only the decoder layers' "
                f"q/k/v, o, gate/up and down projections (embeddings, lm_head and a MoE's "
                f"experts stay FLOAT): quantize with that tensor in disable_names")


def _scheme(path, description, layer, module):
    """The one scheme of `module`'s parts in decoder layer `layer`."""
    found = {}
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
            f"{path}: the parts of model.layers.{layer}.{module} mix schemes ({mixed}); "
            f"msinfer runs them as one fused matmul, which takes one scheme: quantize them "
            f"alike (msModelSlim's disable_names: all of a layer's q/k/v, or gate and up, or "
            f"none). {WORKS}")
    return next(iter(found))


def _check_tensors(model_dir, path, file_of, config, layer_schemes):
    """Every tensor the schemes take is in the files, of an allowed dtype and shape."""
    from safetensors import safe_open
    shapes = config.parameter_shapes()
    handles = {}
    try:
        for layer, signature in enumerate(layer_schemes):
            for module, scheme in zip(MODULES, signature):
                for part in FUSED[module]:
                    prefix = f"model.layers.{layer}.{part}"
                    if prefix + ".weight" not in shapes:  # a MoE's sparse layer: no such part
                        continue
                    n, k = shapes[prefix + ".weight"]
                    for suffix, (dtypes, dims) in TENSORS.get(scheme, FLOAT_TENSORS).items():
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


def preset(scheme, num_layers):
    """A Quantization for a preset model (planning without the checkpoint): every decoder
    projection of its `num_layers` layers in `scheme`, per channel."""
    return Quantization(scheme, "<preset>", "preset", ((scheme,) * len(MODULES),) * num_layers)


def stored_bytes(quantization, name, rows, cols, dtype_bytes):
    """Bytes a rank holds for checkpoint tensor `name` of its (rows, cols) slice: int8
    weights and their per-row scales for a quantized projection (models/quant_loader.py:
    deq_scale float32 and quant_bias int32; weight scale and offset in the compute dtype;
    W8A8's activation scale and offset, whole on every rank, once per fused projection,
    counted with its first part), else rows x cols x dtype_bytes."""
    elements = rows * cols
    if quantization is None or not (name.startswith("model.layers.")
                                    and name.endswith(".weight")):
        return elements * dtype_bytes
    scheme = quantization.scheme_at(name)
    per_row = {"FLOAT": None, "W8A8": 4 + 4, "W8A8_DYNAMIC": dtype_bytes,
               "W8A16": 2 * dtype_bytes}[scheme]
    if per_row is None:
        return elements * dtype_bytes
    per_tensor = 2 * dtype_bytes if scheme == "W8A8" and any(
        name.endswith(f".{part}.weight") for part in FIRST_PARTS) else 0
    return elements + rows * per_row + per_tensor
