"""msModelSlim's quantized checkpoints, made by msModelSlim itself, run as its formula says.

Tiny Qwen2 and Qwen3 checkpoints (tools.tiny_model: peaked, input-dependent logits) are
quantized once per module by msModelSlim's own command line on CPU: W8A8 from a float16
source in its v0 layout, W8A8 from a bfloat16 source in its v1 layout, W8A16 (v0),
W8A8_DYNAMIC (v1, per-token activations), a Qwen3 in W8A8 (v1), and a four-layer W8A8 (v0)
with layer 1's down_proj left float by msModelSlim's disable_names (LEFT_OUT: its Qwen
practices keep some down_proj float); plus its W8A16 directory requantized group-wise
(GROUPED: msModelSlim writes no group-wise int8 on CPU). The reference
is transformers' float model with every quantized linear replaced by msModelSlim's formula over
the tensors it wrote (activations quantized in float32, as the device does; float64 products,
so exact), and the float tensors it left (embeddings, norms, lm_head, q/k/v biases) loaded as
they are.
msinfer must choose the same greedy tokens, and log-probs within LOGPROB_TOLERANCE plus what
the formula itself moves by under a 1e-6 float perturbation (rounding x / input_scale turns a
float difference into a whole int8 step where an activation lies on a boundary:
check_against_formula), on one rank here, on two ranks in one msrun job
(tests/distributed_worker.py), and LEFT_OUT on four (tp4) in the dp2 x tp2 job's start.
Directories msinfer cannot run are refused before any rank starts, naming the file, the
tensor and the scheme.
"""
import fcntl
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("msmodelslim")

from safetensors.numpy import load_file, save_file  # noqa: E402
from test_distributed import msrun_prefix, run_job  # noqa: E402

from msinfer import LLM, MsinferError, SamplingParams  # noqa: E402
from msinfer.cli.main import main  # noqa: E402
from msinfer.config import ModelConfig  # noqa: E402
from msinfer.quantization import weight_files  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "distributed_worker.py")
# Random ids (a run of consecutive ids put activations on rounding boundaries: the formula's
# own log-probs moved by 0.3 under shaken_logprobs); the last spans three prefill chunks.
PROMPTS = [np.random.default_rng(seed).integers(0, 500, n).tolist()
           for seed, n in ((1, 5), (2, 2), (3, 37))]
NEW_TOKENS = 12
LOGPROB_TOLERANCE = 1e-3
ENGINE = dict(max_len=128, block_size=4, max_prefill_tokens=16, max_num_seqs=4,
              kv_cache_memory=1 << 20)
TINY = dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512)
CALIBRATION = ["The quick brown fox jumps over the lazy dog near the river bank.",
               "A language model predicts the next word from the words before it.",
               "Servers with inference cards run quantized weights to save memory.",
               "In the morning the market opens and traders watch the prices move.",
               "Mathematics is the study of numbers, shapes and patterns of change."]
V0 = """apiversion: modelslim_v0
metadata: {{config_id: tiny,
           label: {{w_bit: 8, a_bit: {a_bit}, is_sparse: False, kv_cache: False}}}}
spec:
  calib_cfg: {{w_bit: 8, a_bit: {a_bit}, mm_tensor: False, disable_names: []}}
  calib_dataset: {dataset}
  calib_save_params: {{part_file_size: 4}}
"""
V1 = """apiversion: modelslim_v1
metadata: {{config_id: tiny-v1, label: {{w_bit: 8, a_bit: 8, is_sparse: False, kv_cache: False}}}}
spec:
  process:
    - type: linear_quant
      qconfig:
        act:    {{scope: per_tensor,  dtype: int8, symmetric: False, method: minmax}}
        weight: {{scope: per_channel, dtype: int8, symmetric: True,  method: minmax}}
      include: ["*"]
  runner: model_wise
  dataset: {dataset}
  save: [{{type: ascendv1_saver, part_file_size: 4}}]
"""
# name: (source checkpoint of tools.tiny_model, msModelSlim config, activation bits)
CASES = {
    "qwen2_w8a8_v0_fp16": (dict(TINY, dtype="float16", seed=3), V0, 8),
    "qwen2_w8a8_v1_bf16": (dict(TINY, dtype="bfloat16", seed=4), V1, 8),
    "qwen2_w8a16_v0_fp16": (dict(TINY, dtype="float16", seed=5), V0, 16),
    "qwen2_w8a8_dynamic_v1_bf16": (dict(TINY, dtype="bfloat16", seed=7), V1.replace(
        "{{scope: per_tensor,  dtype: int8, symmetric: False, method: minmax}}",
        "{{scope: per_token, dtype: int8, symmetric: True, method: minmax}}"), 8),
    "qwen3_w8a8_v1_bf16": (dict(TINY, dtype="bfloat16", seed=6, family="qwen3", head_dim=32),
                           V1, 8),
}
# Layer 1's down_proj left float (disable_names), four layers: on CPU two stacks of two layers
# of different kinds, (W8A8, float down) and (W8A8, W8A8), each its own graph.
LEFT_OUT = "qwen2_w8a8_v0_fp16_down1_float"
CASES[LEFT_OUT] = (dict(TINY, layers=4, dtype="float16", seed=8), V0.replace(
    "disable_names: []", "disable_names: [model.layers.1.mlp.down_proj]"), 8)


def quantize(source, family, template, a_bit, out, work):
    """msModelSlim's `quant` command on `source` into `out`, on CPU (`work`: its calibration
    set, its configuration and its working directory)."""
    os.makedirs(work, exist_ok=True)
    dataset = os.path.join(work, "calib.jsonl")
    if not os.path.exists(dataset):
        with open(dataset, "w") as f:
            f.writelines(json.dumps({"inputs_pretokenized": s}) + "\n" for s in CALIBRATION)
    config = os.path.join(work, os.path.basename(out) + ".yaml")
    with open(config, "w") as f:
        f.write(template.format(a_bit=a_bit, dataset=dataset))
    model_type = {"qwen2": "Qwen2-7B", "qwen3": "Qwen3-8B"}[family]
    done = subprocess.run(
        [sys.executable, "-m", "msmodelslim.cli", "quant", "--model_type", model_type,
         "--model_path", source, "--save_path", out, "--device", "cpu",
         "--config_path", config], cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "SUCCESS" in done.stdout + done.stderr, \
        (done.stdout + done.stderr)[-3000:]
    return out


class MadeOnUse(dict):
    """{name: make(name)}, each made when first asked for: the worker that runs this module's
    four-rank job apart from its other tests (conftest.py) makes that job's cases only."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, name):
        self[name] = self.make(name)
        return self[name]


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, shared_dir):
    """{case: quantized directory}, each made by msModelSlim when first asked for, and GROUPED;
    once per test session: in the directory every worker shares (conftest's shared_dir),
    where the first worker to ask makes it and the others wait for it (a quantization is
    15-30 s of CPU, and the workers asked for up to eleven)."""
    work = shared_dir

    def make(name):
        out = os.path.join(work, name)
        with open(out + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
            if not os.path.isdir(out):  # made whole or not at all (renamed when done)
                partial = f"{out}.{os.getpid()}"
                if name == GROUPED:
                    regroup(made["qwen2_w8a16_v0_fp16"], tiny_checkpoint(
                        **CASES["qwen2_w8a16_v0_fp16"][0])[0], partial)
                else:
                    spec, template, a_bit = CASES[name]
                    source, _ = tiny_checkpoint(**spec)
                    quantize(source, spec.get("family", "qwen2"), template, a_bit, partial,
                             os.path.join(work, f"{name}.work"))
                os.replace(partial, out)
        return out
    made = MadeOnUse(make)
    return made


# msModelSlim 26.1.0 writes no group-wise int8 on CPU (v1: "No implementation found" for
# per_group int8): its W8A16 directory with every projection requantized here per group of
# GROUP inputs (asymmetric, scale and offset (out, in / GROUP)), in its tensor names.
GROUPED, GROUP = "qwen2_w8a16_group32", 32


def regroup(quant_dir, source, out):
    shutil.copytree(quant_dir, out)
    float_weights = {}
    for file in os.listdir(source):
        if file.endswith(".safetensors"):
            float_weights.update(load_file(os.path.join(source, file)))
    file_of, _ = weight_files(out)
    for file in set(file_of.values()):
        path = os.path.join(out, file)
        os.chmod(path, 0o644)
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            prefix = name[:-len(".weight_scale")]
            w = float_weights[prefix + ".weight"].astype(np.float32)
            g = w.reshape(w.shape[0], -1, GROUP)
            low, high = g.min(-1), g.max(-1)
            scale = np.maximum(high - low, 1e-6) / 255
            offset = np.round(-128 - low / scale)  # W = (W_q - offset) * scale
            q = np.clip(np.round(g / scale[..., None] + offset[..., None]), -128, 127)
            tensors[prefix + ".weight"] = q.reshape(w.shape).astype(np.int8)
            tensors[name] = scale.astype(np.float32)
            tensors[prefix + ".weight_offset"] = offset.astype(np.float32)
        save_file(tensors, path)
    return out


class FormulaLinear(torch.nn.Module):
    """msModelSlim's formula over its own tensors (float64: the integer products exact)."""

    def __init__(self, scheme, tensors, bias):
        super().__init__()
        self.scheme, self.t, self.bias = scheme, tensors, bias

    def forward(self, x):
        t = self.t
        w = t["weight"].double()
        if self.scheme == "W8A8":
            x_q = torch.clamp(torch.round(x / t["input_scale"].float()
                                          + t["input_offset"].float()), -128, 127)
            deq = t["deq_scale"]
            if deq.dtype == torch.int64:  # float32 bits in an int64
                deq = deq.to(torch.int32).view(torch.float32)
            y = (x_q.double() @ w.T + t["quant_bias"].double()) * deq.double()
            return y.float()  # the float bias is folded into quant_bias
        if self.scheme == "W8A16":  # per channel, or per group of inputs
            scale, offset = t["weight_scale"].double(), t["weight_offset"].double()
            group = w.shape[1] // scale.shape[1]
            w = (w - offset.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)
            y = x.double() @ w.T
        elif self.scheme == "W8A8_DYNAMIC":  # per-token symmetric int8 activations
            # The scale and x / scale in float32, as the device's (and msModelSlim's torch
            # code in the model's dtype): in float64 an activation that lands on k + 0.5 in
            # float32 rounds the other way (0.19 in log-probs on a 20-token prompt).
            scale = x.abs().amax(-1, keepdim=True) / 127
            x_q = torch.clamp(torch.round(x / scale), -128, 127).double()
            y = (x_q @ w.T) * scale.double() * t["weight_scale"].double().reshape(1, -1)
        else:
            raise AssertionError(self.scheme)
        if self.bias is not None:
            y = y + self.bias.double()
        return y.float()


def formula_model(quant_dir):
    """transformers' float model of `quant_dir` with msModelSlim's formula in its linears."""
    config = transformers.AutoConfig.from_pretrained(quant_dir)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    tensors = {}
    for file in set(weight_files(quant_dir)[0].values()):
        tensors.update(load_file(os.path.join(quant_dir, file)))
    with open(os.path.join(quant_dir, "quant_model_description.json")) as f:
        description = json.load(f)
    floats = {k: torch.from_numpy(v.astype(np.float32)) for k, v in tensors.items()
              if description.get(k) == "FLOAT"}
    model.load_state_dict(floats, strict=False)
    for name, module in list(model.named_modules()):
        scheme = description.get(name + ".weight")
        if isinstance(module, torch.nn.Linear) and scheme not in (None, "FLOAT"):
            own = {k[len(name) + 1:]: torch.from_numpy(v) for k, v in tensors.items()
                   if k.startswith(name + ".") and k != name + ".bias"}
            bias = floats.get(name + ".bias")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, FormulaLinear(scheme, own, bias))
    return model


@pytest.fixture(scope="module")
def references(quantized):
    return MadeOnUse(lambda name: formula_model(quantized[name]))


def reference_logprobs(model, prompt, generated):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0]
    end = len(prompt) - 1 + len(generated)
    return torch.log_softmax(logits.double(), -1).numpy()[len(prompt) - 1:end]


def shaken_logprobs(model, prompt, generated):
    """reference_logprobs with the norms' weights moved by +-1e-6 relative: how far the formula
    moves on a float difference of that size (an int8 step of an activation that lay on a
    rounding boundary), which msinfer's float32 arithmetic may differ by as well."""
    norms = [m.weight for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    saved = [w.detach().clone() for w in norms]
    signs = torch.Generator().manual_seed(0)  # per element: a per-token scale moves too
    with torch.no_grad():
        for w in norms:
            w.mul_(1 + 1e-6 * (2 * torch.randint(0, 2, w.shape, generator=signs) - 1))
    try:
        return reference_logprobs(model, prompt, generated)
    finally:
        with torch.no_grad():
            for w, old in zip(norms, saved):
                w.copy_(old)


def check_against_formula(model, tokens, logprobs, name):
    """Greedy tokens (teacher-forced argmax) identical and log-probs within
    LOGPROB_TOLERANCE, plus four times the formula's own move under shaken_logprobs, at each
    step; a step where that move changes the formula's own argmax is not compared (few:
    at most one in five)."""
    steady_steps = total = 0
    for row, prompt in enumerate(PROMPTS):
        generated = list(tokens[row])
        expected = reference_logprobs(model, prompt, generated)
        shaken = shaken_logprobs(model, prompt, generated)
        steady = expected.argmax(-1) == shaken.argmax(-1)
        steady_steps, total = steady_steps + steady.sum(), total + len(steady)
        chosen = np.array(generated)
        assert (chosen[steady] == expected.argmax(-1)[steady]).all(), \
            f"{name}: prompt {row}: {generated} against {expected.argmax(-1).tolist()}"
        found = np.asarray(logprobs[row])  # the worker records the first 9 steps
        steps = min(len(found), len(expected))
        allowed = LOGPROB_TOLERANCE + 4 * np.abs(shaken - expected)[:steps].max(-1)
        diff = np.nanmax(np.abs(found[:steps] - expected[:steps]), -1)
        assert (diff < allowed).all(), \
            f"{name}: prompt {row}: log-probs differ by {diff.tolist()}, allowed {allowed}"
    assert steady_steps >= 0.8 * total, f"{name}: the formula itself is unsteady"


def engine_logprobs(outs, vocab):
    rows = []
    for out in outs:
        table = np.full((len(out.logprobs), vocab), np.nan)
        for i, step in enumerate(out.logprobs):
            table[i, list(step)] = list(step.values())
        rows.append(table)
    return rows


def generate_and_check(llm, references, name):
    vocab = llm.config.vocab_size
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                ignore_eos=True, logprobs=vocab))
    check_against_formula(references[name], [o.token_ids for o in outs],
                          engine_logprobs(outs, vocab), name)
    # The int8 weights stay int8 in memory: no float copy of a quantized projection.
    runner = llm.engine.runner
    held = [t for layer in runner.layer_weights for w in layer
            for t in (w if isinstance(w, tuple) else (w,))]
    int8 = sum(t.nbytes for t in held if str(t.dtype) == "Int8")
    assert int8 > 0.7 * sum(t.nbytes for t in held), "projections are not held as int8"


@pytest.mark.parametrize("name", [n for n in CASES if n != LEFT_OUT] + [GROUPED])
def test_one_rank_generates_what_msmodelslims_formula_does(quantized, references, name):
    generate_and_check(LLM(quantized[name], **ENGINE), references, name)


def test_layers_msmodelslim_left_float_run_in_graphs_of_their_own(quantized, references):
    """LEFT_OUT: layer 1's down_proj FLOAT (its float weight, float matmul), the others
    W8A8. Layers 0-1 and 2-3 are stacks of different kinds: each compiled at warm-up (as
    many graphs as `msinfer plan` counts, and it says which layer is float), nothing while
    generating, and each rank holds what the plan counts (the float down_proj as float)."""
    from msinfer.planning.planner import make_plan

    llm = LLM(quantized[LEFT_OUT], **ENGINE)
    quantization = llm.config.quantization
    assert [quantization.scheme_of("mlp.down_proj", n) for n in range(4)] == \
        ["W8A8", "FLOAT", "W8A8", "W8A8"]
    runner = llm.engine.runner
    stacks = {g.layers for g in runner.graph_of.all() if g.part == "layers"}
    assert stacks == {2}, "the test wants stacks of two layers (CPU's min_layers_per_graph)"
    compiled = llm.engine.warmup()
    report = make_plan(llm.config, llm.strategy, llm.profile, llm.limits,
                       parallel_mode=llm.parallel_mode)
    layer_graphs = sum(g.part == "layers" for g in runner.graph_of.all())
    assert compiled == report.warmup_graphs == runner.graph_count \
        == len(runner.graph_of.all()) + layer_graphs  # a second kind of stack per call kind
    assert "down W8A8, FLOAT in layer 1" in report.quantization
    held = [runner.embed_weight] + [t for layer in runner.layer_weights for w in layer
                                    for t in (w if isinstance(w, tuple) else (w,))]
    held += [w for w in runner.head_weights if w is not runner.embed_weight]
    float_down = runner.layer_weights[1][-1]
    assert str(float_down.dtype) == "Float32" and float_down.shape in ((128, 256), (256, 128))
    # the plan's figure exactly, the activation scales (2 floats per W8A8 projection) too
    assert sum(t.nbytes for t in held) == report.devices[0].weights_bytes
    before = llm.compilations
    generate_and_check(llm, references, LEFT_OUT)
    assert llm.compilations == before, "a graph compiled after warm-up"


def run_job_on(quantized, references, out_dir, strategy, names, ranks, strategies=None):
    """One msrun job of `strategy` running each of `names` (--model2; `strategies`: {name:
    its own strategy file}); every rank's tokens the same, and rank 0's against the
    formula."""
    cmd = (msrun_prefix(ranks, out_dir / "logs")
           + [WORKER, "--model", quantized[names[0]],
              "--strategy", os.path.join(ROOT, "strategies", strategy),
              "--out", str(out_dir), "--prompts", json.dumps(PROMPTS),
              "--new-tokens", str(NEW_TOKENS)])
    for name in names[1:]:
        cmd += ["--model2", quantized[name], "--model2-strategy",
                os.path.join(ROOT, "strategies", (strategies or {}).get(name, strategy))]
    code, out, _ = run_job(cmd)
    logs = "".join(p.read_text() for p in sorted((out_dir / "logs").glob("*.log")))
    assert code == 0, (out + logs)[-4000:]
    for number, name in enumerate(names, start=1):
        suffix = "npz" if number == 1 else f"model{number}.npz"
        found = [dict(np.load(out_dir / f"rank_{r}.{suffix}")) for r in range(ranks)]
        for rank in found[1:]:
            np.testing.assert_array_equal(rank["tokens"], found[0]["tokens"], name)
        check_against_formula(references[name], found[0]["tokens"].tolist(),
                              list(found[0]["logprobs"]), name)


@pytest.mark.multirank(ranks=2)
def test_two_ranks_generate_what_msmodelslims_formula_does(quantized, references,
                                                           tmp_path_factory):
    """One msrun job of two tensor ranks runs W8A8 from fp16 (v0) and from bf16 (v1), W8A16
    per channel and group-wise (--model2; Qwen3's layers are Qwen2's linears): column-parallel
    q/k/v and gate/up split weight, deq_scale, quant_bias and weight scales by output;
    row-parallel o/down split the weight (and group-wise scales) by input and add quant_bias
    once (tensor rank 0). W8A8_DYNAMIC's per-token scale over a split row and LEFT_OUT's float
    down_proj run sharded in the 4-rank job below (its dp2 x tp2 groups are tp2's)."""
    names = ["qwen2_w8a8_v0_fp16", "qwen2_w8a8_v1_bf16", "qwen2_w8a16_v0_fp16", GROUPED]
    run_job_on(quantized, references, tmp_path_factory.mktemp("quant_tp2"), "qwen2_tp2.yaml",
               names, 2)


@pytest.mark.multirank
def test_two_replicas_of_two_ranks_then_four_ranks_generate_what_the_formula_does(
        quantized, references, tmp_path_factory):
    """dp2 x tp2: each replica's tensor group is a sub-group (its AllReduces, the per-token
    maxima's too), on W8A8_DYNAMIC; then, in the same job start, tp4 on LEFT_OUT (W8A8 with
    layer 1's down_proj float): a query head and a quarter of each MLP per rank (o and down
    split by input, quant_bias on tensor rank 0), the 2 KV heads each on 2 ranks."""
    run_job_on(quantized, references, tmp_path_factory.mktemp("quant_dp2tp2"),
               "qwen2_dp2_tp2.yaml", ["qwen2_w8a8_dynamic_v1_bf16", LEFT_OUT], 4,
               strategies={LEFT_OUT: "qwen2_tp4.yaml"})


def copy_with_description(source, target, change):
    shutil.copytree(source, target)
    for path in target.iterdir():
        os.chmod(path, 0o644)
    path = target / "quant_model_description.json"
    description = json.loads(path.read_text())
    change(description)
    path.write_text(json.dumps(description))
    return target


def test_a_w8a8sc_directory_is_refused_before_any_rank_starts(quantized, tmp_path, capsys):
    def compressed(description):
        description["model_quant_type"] = "W8A8SC"
        for key, value in list(description.items()):
            if value == "W8A8":
                description[key] = "W8A8SC"
    model = copy_with_description(quantized["qwen2_w8a8_v0_fp16"], tmp_path / "sc", compressed)
    code = main(["generate", "--model", str(model), "--prompt-ids", "1,2,3"])
    err = capsys.readouterr().err
    assert code != 0
    assert "quant_model_description.json" in err and "model.layers.0.self_attn.q_proj.weight" \
        in err and "W8A8SC" in err and "W8A8_DYNAMIC and W8A16" in err, err
    assert "Traceback" not in err
    # The launcher checks it before it starts a rank: the same message, no job.
    code = main(["launch", "--nproc", "2", "--launcher", "msrun", "--strategy",
                 os.path.join(ROOT, "strategies", "qwen2_tp2.yaml"), "--", "generate",
                 "--model", str(model), "--prompt-ids", "1,2,3"])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("msinfer launch: error: ") and "W8A8SC" in err, err
    assert "Traceback" not in err and "rank" not in err.split("W8A8SC")[0], err


def test_unknown_schemes_missing_tensors_and_wrong_dtypes_name_the_tensor(quantized,
                                                                           tmp_path):
    source = quantized["qwen2_w8a8_v0_fp16"]
    weird = copy_with_description(source, tmp_path / "weird", lambda d: d.update(
        {"model.layers.1.mlp.down_proj.weight": "W2A2"}))
    with pytest.raises(MsinferError, match=r"model.layers.1.mlp.down_proj.weight has scheme "
                                           r"'W2A2'.*W8A8S \(as W8A8\)"):
        ModelConfig.from_model_dir(str(weird))
    # A fused projection's parts in one layer take one scheme (layers may differ: LEFT_OUT)
    mixed = copy_with_description(source, tmp_path / "mixed", lambda d: d.update(
        {"model.layers.1.mlp.gate_proj.weight": "FLOAT"}))
    with pytest.raises(MsinferError, match=r"the parts of model.layers.1.mlp.gate_up_proj mix "
                                           r"schemes \(model.layers.1.mlp.gate_proj.weight: "
                                           r"FLOAT, model.layers.1.mlp.up_proj.weight: W8A8\)"):
        ModelConfig.from_model_dir(str(mixed))
    # A quantized tensor outside the decoder layers' projections (msinfer holds it float)
    head = copy_with_description(source, tmp_path / "head", lambda d: d.update(
        {"lm_head.weight": "W8A8"}))
    with pytest.raises(MsinferError, match=r"lm_head.weight is W8A8; msinfer runs quantized "
                                           r"only the decoder layers' q/k/v, o, gate/up"):
        ModelConfig.from_model_dir(str(head))
    # A projection said FLOAT whose weight the files hold as int8
    left = copy_with_description(source, tmp_path / "left", lambda d: d.update(
        {"model.layers.1.mlp.down_proj.weight": "FLOAT"}))
    with pytest.raises(MsinferError, match=r"model.layers.1.mlp.down_proj.weight \(FLOAT\) is "
                                           r"I8; FLOAT takes F16 or F32 or BF16"):
        ModelConfig.from_model_dir(str(left))
    # A tensor of the wrong dtype, then one missing: named with their file.
    broken = copy_with_description(source, tmp_path / "broken", lambda d: None)
    file = next(p for p in broken.iterdir() if p.name.endswith("-00001-of-00001.safetensors"))
    tensors = load_file(str(file))
    tensors["model.layers.0.mlp.gate_proj.quant_bias"] = \
        tensors["model.layers.0.mlp.gate_proj.quant_bias"].astype(np.float32)
    save_file(tensors, str(file))
    with pytest.raises(MsinferError, match=r"safetensors: model.layers.0.mlp.gate_proj."
                                           r"quant_bias \(W8A8\) is F32; W8A8 takes I32"):
        ModelConfig.from_model_dir(str(broken))
    del tensors["model.layers.0.mlp.gate_proj.quant_bias"]
    save_file(tensors, str(file))
    index = next(p for p in broken.iterdir() if p.name.endswith(".index.json"))
    mapping = json.loads(index.read_text())
    del mapping["weight_map"]["model.layers.0.mlp.gate_proj.quant_bias"]
    index.write_text(json.dumps(mapping))
    with pytest.raises(MsinferError, match=r"model.layers.0.mlp.gate_proj.weight is W8A8, "
                                           r"which takes model.layers.0.mlp.gate_proj."
                                           r"quant_bias; no quant_model_weight"):
        ModelConfig.from_model_dir(str(broken))


def test_the_quantization_flag_forces_or_refuses(quantized, small_checkpoint, capsys):
    plan = ["plan", "--strategy", os.path.join(ROOT, "strategies", "qwen2_tp1.yaml"),
            "--hardware", "cpu"]
    assert main(plan + ["--model", quantized["qwen2_w8a16_v0_fp16"]]) == 0
    assert "quantized  W8A16" in capsys.readouterr().out
    assert main(plan + ["--model", quantized["qwen2_w8a16_v0_fp16"],
                        "--quantization", "none"]) == 2
    assert "--quantization none" in capsys.readouterr().err
    assert main(plan + ["--model", small_checkpoint, "--quantization", "msmodelslim"]) == 2
    assert "no quant_model_description.json" in capsys.readouterr().err


def semi_auto_runner(model_dir):
    """The semi_auto runner of one rank on `model_dir`, its weights loaded (not run: its
    Ascend primitives have no CPU kernel), and its plan."""
    import mindspore as ms

    from msinfer.config import load_config
    from msinfer.engine.model_runner import build_runner
    from msinfer.engine_config import EngineLimits
    from msinfer.hardware import get_profile
    from msinfer.layers.parallel_context import ParallelContext
    from msinfer.parallel.distributed import set_graph_mode
    from msinfer.parallel.strategy import Strategy
    from msinfer.planning.kv_layout import CacheLayout

    config = load_config(model_dir)
    set_graph_mode("CPU")
    plan = Strategy.default(parallel_mode="semi_auto").resolve(config)
    ctx = ParallelContext(config=config, plan=plan, mode="semi_auto", dtype=ms.float32)
    layout = CacheLayout(config.num_layers, plan.local_kv_heads, config.head_dim,
                         block_size=4, num_blocks=8, dtype_bytes=4)
    limits = EngineLimits(max_num_seqs=2, max_prefill_tokens=16, max_model_len=32)
    return build_runner(model_dir, ctx, layout, limits, 1, get_profile("cpu")), plan


def test_semi_auto_holds_each_quantized_tensor_and_every_rank_a_row_layers_quant_bias(
        quantized):
    """semi_auto (its layout checked by `msinfer layouts`, tests/tools/test_layouts.py): the
    model's Parameters take the loader's tensors in their own dtypes, and a row-parallel
    layer's quant_bias is on every rank (the Ascend method adds it after MindSpore's sum),
    where explicit mode keeps it on tensor rank 0 only."""
    import mindspore as ms

    from msinfer.config import load_config
    from msinfer.layers.linear_methods import AscendW8A8Method
    from msinfer.models.quant_loader import quantized_rank_weights
    from msinfer.parallel.strategy import Strategy

    model_dir = quantized["qwen2_w8a8_v0_fp16"]
    config = load_config(model_dir)
    down = "model.layers.0.mlp.down_proj.weight"
    bias = AscendW8A8Method.TENSORS.index("quant_bias")
    tp2 = Strategy.default(tensor=2, parallel_mode="semi_auto").resolve(config)
    explicit, = (a for _, a in quantized_rank_weights(model_dir, tp2, 1, [down], np.float32))
    semi_auto, = (a for _, a in quantized_rank_weights(model_dir, tp2, 1, [down], np.float32,
                                                       bias_on_rank_0=False))
    assert not explicit[bias].any() and semi_auto[bias].any()

    runner, plan = semi_auto_runner(model_dir)
    names = [n for n in runner.model.weights if config.quantization.scheme_at(n) == "W8A8"]
    assert names and all(isinstance(runner.model.weights[n], tuple) for n in names)
    loaded = dict(quantized_rank_weights(model_dir, plan, 0, names, np.float32,
                                         bias_on_rank_0=False))
    for name in names:
        held = runner.model.weights[name]
        assert [p.name.rsplit(".", 1)[1] for p in held] == list(AscendW8A8Method.TENSORS)
        assert [p.dtype for p in held] == [ms.int8, ms.float32, ms.int32, ms.float32,
                                           ms.float32]
        for param, array in zip(held, loaded[name]):
            np.testing.assert_array_equal(param.asnumpy(), array)


def test_semi_auto_refuses_group_wise_scales_when_loading(quantized):
    from msinfer.errors import MsinferError

    with pytest.raises(MsinferError, match=r"qkv_proj.weight_scale: 4 groups of scales; "
                                           r"semi_auto lays out per-channel scales only"):
        semi_auto_runner(quantized[GROUPED])


def test_integer_products_are_exact_past_float32s_reach():
    """x_q @ W_q.T over 4,864 inputs (the 0.5B shape's down_proj): float32 alone is exact to
    2**24 only; runs of at most 1,032 inputs, summed in int32, are exact at the extremes."""
    import mindspore as ms

    from msinfer.layers.linear_methods import IntegerMatmul

    rng = np.random.default_rng(0)
    x = np.full((3, 4864), -128, np.float32)
    w = np.full((5, 4864), -128, np.int8)
    x[1], w[1:] = rng.integers(-128, 128, 4864), rng.integers(-128, 128, (4, 4864))
    x[2, ::2] = 127
    found = IntegerMatmul(4864)(ms.Tensor(x), ms.Tensor(w)).asnumpy()
    assert found.dtype == np.int32
    np.testing.assert_array_equal(found, x.astype(np.int64) @ w.astype(np.int64).T)
