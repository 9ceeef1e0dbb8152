"""Qwen3 dense: parity with Hugging Face transformers' own Qwen3ForCausalLM, the shard plan of
its per-head norms, the planner's presets and refusals, and `msinfer layouts` on the shipped
strategies.

The checkpoints are made with transformers' classes (Qwen3Config, Qwen3ForCausalLM,
save_pretrained), not msinfer's maker: head_dim != hidden / heads, tied and untied embeddings,
bfloat16 on disk. Their weights are tools.tiny_model's random values (peaked, input-dependent
logits: transformers' own initialisation gives near-uniform ones, whose greedy choice is a
coin toss at 1e-4). The engine runs as tests/models/test_hf_parity.py runs Qwen2: KV blocks of 4
tokens, prefill chunks of 16 (a 37-token prompt takes three chunks and ten blocks), log-probs
of the whole vocabulary within 1e-4 of transformers' in float32, greedy tokens identical.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_parity import (ENGINE, NEW_TOKENS, assert_matches_hf, greedy,  # noqa: E402
                            prompts_for)

from msinfer import LLM, SamplingParams  # noqa: E402
from msinfer.cli.main import main  # noqa: E402
from msinfer.config import PRESETS, ModelConfig  # noqa: E402
from msinfer.errors import MsinferError  # noqa: E402
from msinfer.parallel.strategy import Strategy, load_strategy  # noqa: E402
from msinfer.tools.tiny_model import random_tensor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGIES = os.path.join(ROOT, "strategies")

HF_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def make_hf_checkpoint(path, family="qwen3", *, layers=2, hidden=64, heads=4, kv_heads=2,
                       head_dim=None, intermediate=176, vocab=384, tie=False, seed=1,
                       max_position=128, rope=None, config_style="5"):
    """A random checkpoint written by transformers' own classes, in bfloat16: `rope` adds to
    the rope parameters (e.g. yarn); config_style "4" rewrites config.json as released Qwen2.5
    checkpoints spell it (top-level rope_theta, rope_scaling with `type`). Returns the path."""
    config_class, model_class = (getattr(transformers, n) for n in HF_CLASSES[family])
    extra = {"head_dim": head_dim} if head_dim else {}
    config = config_class(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_position, tie_word_embeddings=tie, rms_norm_eps=1e-6,
        rope_parameters=dict({"rope_type": "default", "rope_theta": 1e6}, **(rope or {})),
        bos_token_id=0, eos_token_id=1, **extra)
    model = model_class(config)
    with torch.no_grad():  # a tied lm_head is the embedding: named_parameters lists it once
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(random_tensor(name, tuple(param.shape), seed)))
    model.to(torch.bfloat16).save_pretrained(path)
    if config_style == "4":
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            raw = json.load(f)
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        kind = params.pop("rope_type")
        params.pop("type", None)
        raw["rope_scaling"] = dict(params, type=kind) if kind != "default" else None
        raw["torch_dtype"] = raw.pop("dtype")
        with open(config_path, "w") as f:
            json.dump(raw, f, indent=2)
    return path


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, **make_hf_checkpoint arguments) -> (directory, ModelConfig,
    transformers' model on it in float32), made once per session per name."""
    made = {}

    def make(name, **spec):
        if name not in made:
            path = make_hf_checkpoint(str(tmp_path_factory.mktemp(name) / "model"), **spec)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32).eval()
            made[name] = (path, ModelConfig.from_model_dir(path), hf)
        return made[name]
    return make


CASES = {
    # 4 query heads of 32 over 2 KV heads: q is 128 wide over a hidden size of 64.
    "qwen3_untied": dict(heads=4, kv_heads=2, head_dim=32, tie=False),
    # Tied embeddings, 8 heads of 16 over 4 KV heads (q 128 wide over 64), three layers.
    "qwen3_tied": dict(heads=8, kv_heads=4, head_dim=16, tie=True, layers=3, seed=2),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, hf_checkpoint):
    path, config, hf = hf_checkpoint(request.param, **CASES[request.param])
    return request.param, config, LLM(path, **ENGINE), hf


def test_checkpoints_are_transformers_qwen3_with_head_dim_apart_from_hidden(case):
    name, config, llm, hf = case
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert config.model_type == "qwen3" and config.torch_dtype == "bfloat16"
    assert config.num_heads * config.head_dim != config.hidden_size
    assert config.head_dim == hf.config.head_dim
    layer = hf.model.layers[0].self_attn
    assert layer.q_proj.bias is None and tuple(layer.q_norm.weight.shape) == (config.head_dim,)
    assert config.tie_word_embeddings == (name == "qwen3_tied")


def test_logprobs_and_32_greedy_tokens_match_transformers(case):
    """Prompts of 5, 11, 37 (three chunks, ten blocks) and 1 token (straight to decode)."""
    name, config, llm, hf = case
    prompts = prompts_for(config.vocab_size)
    outs = llm.generate(prompts, greedy(config.vocab_size))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert len(out.token_ids) == NEW_TOKENS and out.finish_reason == "length"
        assert_matches_hf(hf, prompt, out, config.vocab_size, f"{name} prompt {i}")
    assert llm.engine.stats().num_blocks_used == 0


def test_transformers_generate_gives_the_same_tokens(case):
    name, config, llm, hf = case
    prompt = prompts_for(config.vocab_size, seed=5)[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                ignore_eos=True))[0]
    ids = torch.tensor([prompt])
    # the mask given: a prompt token equal to pad_token_id would otherwise be masked out
    hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == hf_out[0, len(prompt):].tolist()


def test_the_engine_holds_the_norms_whole_and_qkv_without_bias(case):
    name, config, llm, hf = case
    runner = llm.engine.runner
    names = runner.family.layer_weight_names(0)
    assert runner.family.__name__ == "msinfer.models.qwen3"
    assert not [n for n in names if n.endswith(".bias")]
    held = dict(zip(names, runner.layer_weights[0]))
    for norm in ("q_norm", "k_norm"):
        weight = held[f"model.layers.0.self_attn.{norm}.weight"]
        expected = getattr(hf.model.layers[0].self_attn, norm).weight.detach().numpy()
        np.testing.assert_array_equal(weight.asnumpy(), expected)


def test_semi_auto_qwen3_model_with_tp4_shard_annotations_matches_hf_standalone(hf_checkpoint):
    """The semi_auto whole-model Cell (full-shape Parameters, shard() from the plan, ignored
    stand-alone) with the ranks' fused q/k/v blocks side by side, as test_hf_parity does for
    Qwen2: it must still be Qwen3, q/k norms included."""
    import mindspore as ms

    from msinfer.engine import LLMEngine
    from msinfer.engine.model_runner import SemiAutoRunner
    from msinfer.layers.parallel_context import ParallelContext
    from msinfer.models import qwen3
    from msinfer.models.loader import Checkpoint
    from msinfer.parallel.distributed import set_graph_mode
    from msinfer.parallel.strategy import checkpoint_parts
    from msinfer.planning.kv_layout import CacheLayout

    model_dir, config, hf = hf_checkpoint("qwen3_tied", **CASES["qwen3_tied"])
    tensor = 4
    plan = Strategy.default(tensor=tensor, parallel_mode="semi_auto").resolve(config)
    set_graph_mode("CPU")
    ctx = ParallelContext(config=config, plan=plan, mode="semi_auto", dtype=ms.float32)
    layout = CacheLayout(config.num_layers, plan.local_kv_heads, config.head_dim,
                         block_size=4, num_blocks=64, dtype_bytes=4)
    shapes = config.parameter_shapes()
    names = qwen3.weight_names(config)
    checkpoint = Checkpoint(model_dir)

    def rank_parts(rank):
        return lambda n: [(p, plan.slices(p, rank), shapes[p]) for p in checkpoint_parts(n)]

    ranks = [dict(checkpoint.load(names, rank_parts(r), np.float32)) for r in range(tensor)]
    whole = dict(checkpoint.load(names, lambda n: [(p, tuple(slice(0, s) for s in shapes[p]),
                                                    shapes[p]) for p in checkpoint_parts(n)],
                                 np.float32))
    full = {name: (np.concatenate([r[name] for r in ranks])
                   if len(checkpoint_parts(name)) > 1 else whole[name]) for name in names}
    assert full["model.embed_tokens.weight"].shape == (config.vocab_size, config.hidden_size)
    model = qwen3.Model(ctx, layout, {n: a.shape for n, a in full.items()})
    assert model.layer.q_norm.to_float.in_strategy == ((1, tensor, 1),)
    for name, array in full.items():
        model.weights[name].set_data(ms.Tensor(array))
    runner = SemiAutoRunner(ctx, layout, max_num_seqs=4, max_prefill_tokens=16,
                            max_model_len=128, model=model)
    engine = LLMEngine(runner, layout, vocab_size=config.vocab_size, max_model_len=128,
                       eos_token_ids=(), max_num_seqs=4, max_prefill_tokens=16, seed=0)
    prompts = prompts_for(config.vocab_size, seed=9)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(config.vocab_size, 12))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    for i, prompt in enumerate(prompts):
        assert_matches_hf(hf, prompt, finished[str(i)], config.vocab_size, f"prompt {i}")


# ---- shard plans ----

def test_shipped_strategies_replicate_the_per_head_norms_without_a_rule():
    config = PRESETS["qwen3-8b"]
    for name in ("qwen2_tp1", "qwen2_tp2", "qwen2_tp4", "qwen2_tp8", "qwen2_dp2_tp2"):
        plan = load_strategy(os.path.join(STRATEGIES, name + ".yaml")).resolve(config)
        for norm in ("q_norm", "k_norm"):
            weight = f"model.layers.3.self_attn.{norm}.weight"
            assert plan.style(weight) == "replicate"
            assert plan.local_shape(weight) == (128,)
        q = plan.local_shape("model.layers.0.self_attn.qkv_proj.weight")
        assert q == ((32 + 2 * 8) * 128 // plan.tensor, 4096)


def test_a_rule_may_name_the_per_head_norms_but_only_replicate_them():
    rules = dict(Strategy.default(tensor=2).rules)
    ok = Strategy(world_size=2, tensor=2, rules=dict(
        rules, **{"model.layers.*.self_attn.q_norm": "replicate"}))
    assert ok.resolve(PRESETS["qwen3-8b"]).style(
        "model.layers.0.self_attn.q_norm.weight") == "replicate"
    bad = Strategy(world_size=2, tensor=2, rules=dict(
        rules, **{"model.layers.*.self_attn.k_norm": "colwise"}))
    with pytest.raises(MsinferError, match="k_norm cannot be colwise; msinfer runs it as "
                                           "replicate"):
        bad.resolve(PRESETS["qwen3-8b"])


# ---- the planner ----

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "msinfer", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_plan_qwen3_32b_tp4_on_300i_duo_at_its_native_40960(capsys):
    code = main(["plan", "--model", "qwen3-32b", "--strategy",
                 os.path.join(STRATEGIES, "qwen2_tp4.yaml"), "--hardware", "atlas-300i-duo",
                 "--max-len", "40960", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["fits"], report["errors"]
    assert report["dtype"] == "float16" and report["max_len"] == 40960
    # 64 layers x K and V x 2 KV heads per rank x head_dim 128 x 2 bytes
    assert report["kv_bytes_per_token"] == 64 * 2 * 2 * 128 * 2
    weights = PRESETS["qwen3-32b"].num_parameters() * 2
    assert abs(sum(d["weights_bytes"] for d in report["devices"]) - weights) < 0.01 * weights
    assert report["concurrent_max_len_sequences"] >= 1


def test_plan_qwen25_yarn_reaches_131072_and_the_native_preset_refuses_it(capsys):
    tp4 = os.path.join(STRATEGIES, "qwen2_tp4.yaml")
    args = ["--strategy", tp4, "--hardware", "atlas-800i-a2", "--max-len", "131072", "--json"]
    assert main(["plan", "--model", "qwen2.5-7b-yarn", *args]) == 0
    assert json.loads(capsys.readouterr().out)["max_len"] == 131072
    assert main(["plan", "--model", "qwen2.5-7b", *args]) == 2
    err = capsys.readouterr().err
    assert "max_len 131072 exceeds the model's max_position_embeddings 32768" in err


def deploy_guide_plan_rows():
    """The rows of docs/deploy-300i-duo.md's Qwen3-32B / Qwen2.5-72B table, as cells."""
    with open(os.path.join(ROOT, "docs", "deploy-300i-duo.md")) as f:
        text = f.read()
    table = text.split("### Qwen3-32B and Qwen2.5-72B on four chips")[1].split("\n\n")[2]
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in table.splitlines()[2:]]


@pytest.mark.parametrize("row", deploy_guide_plan_rows(), ids=lambda row: row[0])
def test_the_deploy_guides_qwen3_and_qwen25_plans_are_what_the_planner_says(capsys, row):
    """Each figure of the guide's table (weights, KV cache and workspace per chip, whole
    sequences at once, decode bounds, verdict) as `msinfer plan` computes it now."""
    what, memory, sequences, bound, verdict = row
    preset, tensor, max_len = [c.strip() for c in what.split(",", 2)]
    args = ["plan", "--model", preset, "--hardware", "atlas-300i-duo", "--json",
            "--strategy", os.path.join(STRATEGIES, f"qwen2_{tensor}.yaml"),
            "--max-len", max_len.split()[0].replace(",", "")]
    if "batch" in max_len:
        args += ["--max-num-seqs", max_len.split("batch")[1].strip()]
    code = main(args)
    report = json.loads(capsys.readouterr().out)
    gib = [round(report["devices"][0][k] / 2**30, 2)
           for k in ("weights_bytes", "kv_cache_bytes", "workspace_bytes")]
    assert memory.split(" = ")[0] == " + ".join(f"{v:.2f}" for v in gib)
    assert int(sequences.split()[0]) == report["concurrent_max_len_sequences"]
    assert verdict.startswith("fits") == report["fits"] == (code == 0)
    if report["fits"]:
        full, short = bound.split(" (")
        assert float(full) == round(report["decode_tokens_per_s_bound"], 1)
        assert float(short.split()[0]) == round(
            report["decode_tokens_per_s_bound_short_context"], 1)
        free = min(d["capacity_bytes"] - d["total_bytes"] for d in report["devices"]) / 2**30
        assert "free" not in verdict or f"{free:.2f} free" in verdict
    else:
        assert any("with tensor: 8" in e and "--max-len 50672" in e for e in report["errors"])


@pytest.mark.parametrize("config, field", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type 'llama'"),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "architectures ['Qwen3MoeForCausalLM']"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}},
     "rope_parameters.rope_type 'longrope'"),
])
def test_plan_refuses_an_unsupported_checkpoint_in_one_line_naming_the_field(tmp_path, config,
                                                                           field):
    raw = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 512,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, **config)))
    done = run_cli("plan", "--model", str(tmp_path), "--strategy",
                   os.path.join(STRATEGIES, "qwen2_tp1.yaml"), "--hardware", "cpu")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and field in lines[0] and "config.json" in lines[0], done.stderr
    assert "is not supported" in lines[0] and "msinfer runs" in lines[0]


# ---- msinfer layouts: the semi_auto model's primitives on the shipped strategies ----

@pytest.mark.parametrize("model, strategy", [
    *[("qwen3-0.6b", s) for s in ("qwen2_tp1", "qwen2_tp2", "qwen2_tp4", "qwen2_tp8",
                                  "qwen2_dp2_tp2")],
    ("qwen3-32b", "qwen2_tp4"), ("qwen3-32b", "qwen2_tp8")])
def test_layouts_clean_for_qwen3_on_every_shipped_strategy(model, strategy, capsys):
    """Every Qwen3 dense model has 8 KV heads: semi_auto is legal on every shipped strategy.
    Qwen3-0.6B (tied, head_dim 128 over hidden / heads 64) on all of them, Qwen3-32B (64
    heads, untied) where it would be served, tp4 and tp8."""
    code = main(["layouts", "--model", model, "--strategy",
                 os.path.join(STRATEGIES, strategy + ".yaml"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["violations"] == [], report.get("violations")
    tensor = report["tensor"]
    # The q/k norms: per head, over head_dim, heads split as attention's are.
    norms = [c for c in report["calls"] if c["source"].startswith("layers/norm.py")
             and len(c["inputs"][0]) == 3]
    assert norms and all(c["in_strategy"][0] == [1, tensor, 1] for c in norms
                         if c["op"] == "ReduceMean")
