"""Qwen3 dense beyond parity (tests/models/test_parity.py runs it against transformers' own
Qwen3ForCausalLM): the shard plan of its per-head norms, the planner's presets and refusals,
and `msinfer layouts` on the shipped strategies."""
import json
import os
import subprocess
import sys

import pytest

from msinfer.cli.main import main
from msinfer.config import PRESETS
from msinfer.errors import MsinferError
from msinfer.parallel.strategy import Strategy, load_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGIES = os.path.join(ROOT, "strategies")


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
    assert report["dtype"] == "float16" and report["max_model_len"] == 40960
    # 64 layers x K and V x 2 KV heads per rank x head_dim 128 x 2 bytes
    assert report["kv_bytes_per_token"] == 64 * 2 * 2 * 128 * 2
    weights = PRESETS["qwen3-32b"].num_parameters() * 2
    assert abs(sum(d["weights_bytes"] for d in report["devices"]) - weights) < 0.01 * weights
    assert report["max_concurrency"] >= 1
    assert report["concurrent_max_len_sequences"] == report["max_concurrency"]  # the old key


def test_plan_qwen25_yarn_reaches_131072_and_the_native_preset_refuses_it(capsys):
    tp4 = os.path.join(STRATEGIES, "qwen2_tp4.yaml")
    args = ["--strategy", tp4, "--hardware", "atlas-800i-a2", "--max-len", "131072", "--json"]
    assert main(["plan", "--model", "qwen2.5-7b-yarn", *args]) == 0
    assert json.loads(capsys.readouterr().out)["max_model_len"] == 131072
    assert main(["plan", "--model", "qwen2.5-7b", *args]) == 2
    err = capsys.readouterr().err
    assert "max_model_len 131072 exceeds the model's max_position_embeddings 32768" in err


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
    assert int(sequences.split()[0]) == report["max_concurrency"]
    assert verdict.startswith("fits") == report["fits"] == (code == 0)
    if report["fits"]:
        full, short = bound.split(" (")
        assert float(full) == round(report["decode_tokens_per_s_bound"], 1)
        assert float(short.split()[0]) == round(
            report["decode_tokens_per_s_bound_short_context"], 1)
        free = min(d["capacity_bytes"] - d["total_bytes"] for d in report["devices"]) / 2**30
        assert "free" not in verdict or f"{free:.2f} free" in verdict
    else:
        assert any("with tensor: 8" in e and "--max-model-len 50672" in e for e in report["errors"])


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
