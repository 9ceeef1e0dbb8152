import json
import os
import re

import pytest

from msinfer.cli import main as cli
from msinfer.config import PRESETS, load_config
from msinfer.errors import MsinferError, PlanRefused
from msinfer.hardware import GiB, compute_dtype, get_profile
from msinfer.parallel.strategy import Strategy, load_strategy
from msinfer.engine_config import EngineLimits
from msinfer.planning.planner import check_plan_or_raise, format_plan, make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGIES = os.path.join(ROOT, "strategies")
DUO = get_profile("atlas-300i-duo")

# Qwen2-72B by hand: hidden 8192, intermediate 29568, vocab 152064, 80 layers, 64 query heads
# and 8 KV heads of 128. What tensor parallelism splits, and what every rank holds whole:
_PER_LAYER = ((8192 * 8192 + 8192)               # q_proj weight + bias
              + 2 * (1024 * 8192 + 1024)         # k_proj, v_proj weight + bias
              + 8192 * 8192                      # o_proj
              + 3 * 29568 * 8192)                # gate, up, down
SPLIT_72B = 80 * _PER_LAYER + 2 * 152064 * 8192  # + embedding and lm_head
WHOLE_72B = (2 * 80 + 1) * 8192                  # the RMSNorm weights


def strategy(name):
    return load_strategy(os.path.join(STRATEGIES, name))


def plan_for(model, name, hardware="atlas-300i-duo", dtype=None, parallel_mode=None,
             **limits):
    config = load_config(model)
    return make_plan(config, strategy(name), get_profile(hardware),
                     EngineLimits.for_model(config, **limits), dtype, parallel_mode)


def block_bytes(layers, kv_heads, block_size=16, dtype_bytes=2, head_dim=128):
    """K and V x layers x block x local KV heads x head_dim x bytes."""
    return 2 * layers * block_size * kv_heads * head_dim * dtype_bytes


@pytest.mark.parametrize("model,count", [
    ("qwen2-0.5b", 494_032_768), ("qwen2-1.5b", 1_543_714_304),
    ("qwen2-7b", 7_615_616_512), ("qwen2-72b", 72_706_203_648)])
def test_published_qwen2_parameter_counts(model, count):
    assert PRESETS[model].num_parameters() == count


def test_72b_float16_weight_bytes_per_device_on_tp4_and_tp8():
    assert SPLIT_72B + WHOLE_72B == 72_706_203_648
    tp4 = plan_for("qwen2-72b", "qwen2_tp4.yaml")
    tp8 = plan_for("qwen2-72b", "qwen2_tp8.yaml")
    assert tp4.dtype == tp8.dtype == "float16"
    assert [d.weights_bytes for d in tp4.devices] == [2 * (SPLIT_72B // 4 + WHOLE_72B)] * 4
    assert [d.weights_bytes for d in tp8.devices] == [2 * (SPLIT_72B // 8 + WHOLE_72B)] * 8
    assert tp4.devices[0].weights_bytes == 36_355_080_192
    assert tp8.devices[0].weights_bytes == 18_178_859_008


def test_kv_cache_is_a_pool_of_blocks_sized_from_the_budget():
    per_block = block_bytes(80, 2)  # Qwen2-72B at tp4: 2 of 8 KV heads per rank, fp16
    assert per_block == 1_310_720
    plan = plan_for("qwen2-72b", "qwen2_tp4.yaml", kv_cache_memory=GiB)
    blocks = GiB // per_block  # 819, one of them reserved
    assert plan.kv_blocks == blocks - 1 and plan.kv_tokens == (blocks - 1) * 16
    assert plan.devices[0].kv_cache_bytes == blocks * per_block
    assert plan.max_concurrency == (blocks - 1) * 16 // 4096
    tp8 = plan_for("qwen2-72b", "qwen2_tp8.yaml", kv_cache_memory=GiB)
    assert tp8.kv_blocks == GiB // block_bytes(80, 1) - 1  # half the heads: twice the blocks


def test_default_pool_fills_what_is_left_but_never_more_than_max_num_seqs_can_use():
    capped = plan_for("qwen2-72b", "qwen2_tp8.yaml", max_num_seqs=2, max_len=4096)
    assert capped.kv_blocks == 2 * 4096 // 16
    free = plan_for("qwen2-72b", "qwen2_tp4.yaml", max_num_seqs=16, max_len=32768)
    d = free.devices[0]
    left = d.capacity_bytes - d.weights_bytes - d.workspace_bytes
    assert d.kv_cache_bytes <= 0.9 * left < d.kv_cache_bytes + block_bytes(80, 2)


def test_72b_on_four_300i_duo_devices_holds_a_32k_context():
    plan = plan_for("qwen2-72b", "qwen2_tp4.yaml", max_len=32768)
    assert plan.fits, plan.errors
    assert plan.max_concurrency >= 1
    assert all(d.margin_bytes >= 0 for d in plan.devices)


def test_replicated_kv_heads_are_counted_and_said():
    # Qwen2-1.5B: 2 KV heads over 4 ranks, so every rank keeps one whole KV head.
    plan = plan_for("qwen2-1.5b", "qwen2_tp4.yaml", kv_cache_memory=GiB, max_num_seqs=64)
    assert plan.kv_blocks == GiB // block_bytes(28, 1) - 1
    assert any("each KV head is replicated on 2 consecutive ranks" in n for n in plan.notes)


def test_data_replicas_each_hold_a_tensor_parallel_copy_and_their_own_cache():
    plan = plan_for("qwen2-7b", "qwen2_dp2_tp2.yaml", max_num_seqs=4)
    tp2 = plan_for("qwen2-7b", "qwen2_tp2.yaml", max_num_seqs=4)
    assert [d.weights_bytes for d in plan.devices] == [tp2.devices[0].weights_bytes] * 4
    assert plan.devices[3].kv_cache_bytes == tp2.devices[0].kv_cache_bytes
    assert [(d.data_rank, d.tensor_rank) for d in plan.devices] == [(0, 0), (0, 1), (1, 0),
                                                                    (1, 1)]


def test_workspace_is_one_layer_of_the_largest_call():
    plan = plan_for("qwen2-72b", "qwen2_tp4.yaml", max_len=4096, max_prefill_tokens=256,
                    max_num_seqs=16)
    per_token = 2 * (6 * 8192 + 2 * (16 + 2 * 2) * 128 + 4 * 29568 // 4)

    def call(tokens, contexts):  # the gathered K/V context, and again laid out by head
        gathered = 4 * contexts * 4096 * 2 * 128 * 2
        return tokens * per_token + gathered + 3 * tokens * 16 * 4096 * 4 + tokens * 4096 * 4

    logits = 16 * 152064 * 4
    expected = 2 * GiB + max(call(256, 1), call(16, 16)) + logits
    assert plan.devices[0].workspace_bytes == expected
    assert plan.devices[0].total_bytes == sum(
        getattr(plan.devices[0], k) for k in ("weights_bytes", "kv_cache_bytes",
                                              "workspace_bytes"))
    # Bounded by the chunk, not the prompt: a longer chunk costs more, the same max-len.
    longer = plan_for("qwen2-72b", "qwen2_tp4.yaml", max_len=4096, max_prefill_tokens=1024)
    assert longer.devices[0].workspace_bytes > plan.devices[0].workspace_bytes


def test_cpu_workspace_reserves_two_layers_of_the_largest_call():
    """On the CPU backend a graph runs at least two decoder layers (planning/workspace.py), so
    the reserve is two layers of the largest call where an Ascend plan reserves one."""
    from msinfer.planning.workspace import largest_call_bytes

    limits = dict(max_len=1024, max_prefill_tokens=256, max_num_seqs=16)
    cpu = plan_for("qwen2-0.5b", "qwen2_tp1.yaml", hardware="cpu", **limits)
    config = load_config("qwen2-0.5b")
    shard = Strategy.default().resolve(config, "explicit")
    sizes = EngineLimits(max_model_len=1024, max_prefill_tokens=256, max_num_seqs=16)
    one = largest_call_bytes(shard, 4, sizes)
    assert largest_call_bytes(shard, 4, sizes, layers=2) == 2 * one
    logits = 16 * config.vocab_size * 4
    assert cpu.devices[0].workspace_bytes == get_profile("cpu").runtime_reserve_bytes + \
        2 * one + logits
    assert "2 decoder layers of the largest call" in cpu.workspace_formula


def test_72b_fits_four_and_eight_300i_duo_devices():
    for name in ("qwen2_tp4.yaml", "qwen2_tp8.yaml"):
        plan = plan_for("qwen2-72b", name)
        assert plan.fits and not plan.errors
        assert all(d.capacity_bytes == 43693 * 1024 ** 2 for d in plan.devices)
        assert "FITS" in format_plan(plan)


def test_collectives_per_decoded_token():
    plan = plan_for("qwen2-72b", "qwen2_tp4.yaml", max_num_seqs=2)
    reduce, gather = plan.collectives_per_token
    assert (reduce.kind, reduce.count, reduce.payload_bytes) == ("AllReduce", 1 + 80 + 80,
                                                                 2 * 8192 * 2)
    assert (gather.kind, gather.count, gather.payload_bytes) == ("AllGather", 1, 2 * 152064 * 2)
    assert plan_for("qwen2-72b", "qwen2_tp1.yaml", hardware="cpu").collectives_per_token == []


def test_decode_bound_is_bandwidth_over_bytes_each_device_reads():
    plan = plan_for("qwen2-72b", "qwen2_tp8.yaml", max_num_seqs=1, max_len=4096)
    embedding = 152064 * 8192 // 8 * 2  # looked up by row, not read whole
    kv = 80 * 2 * 4096 * 1 * 128 * 2  # one full context
    read = 18_178_859_008 - embedding + kv
    assert plan.decode_bytes_per_step == read
    assert plan.decode_tokens_per_s_bound == pytest.approx(204e9 / read)
    assert plan.decode_tokens_per_s_bound_short_context == pytest.approx(
        204e9 / (read - kv))
    batch4 = plan_for("qwen2-72b", "qwen2_tp8.yaml", max_num_seqs=4, max_len=4096)
    assert batch4.decode_tokens_per_s_bound == pytest.approx(4 * 204e9 / (read + 3 * kv))


def test_72b_on_two_devices_is_refused_naming_the_smallest_degree_that_fits():
    plan = plan_for("qwen2-72b", "qwen2_tp2.yaml")
    assert not plan.fits
    # weights 66.43 GiB + workspace; no room for any KV cache
    assert plan.errors[0].startswith("does not fit: rank 0 needs 70.17 GiB of 42.67 GiB")
    assert "with tensor: 4 (world_size 4) it fits" in plan.errors[0]


def test_a_chunk_too_big_for_a_32k_context_names_the_longest_max_len_that_fits():
    limits = dict(max_len=32768, max_prefill_tokens=8192)
    plan = plan_for("qwen2-72b", "qwen2_tp4.yaml", **limits)
    message = plan.errors[0]
    assert "no tensor degree up to 8 fits max-model-len 32768" in message
    longest = int(re.search(r"with --max-model-len (\d+) it fits at tensor 4", message).group(1))
    assert plan_for("qwen2-72b", "qwen2_tp4.yaml", **dict(limits, max_len=longest)).fits
    assert not plan_for("qwen2-72b", "qwen2_tp4.yaml", **dict(limits, max_len=longest + 1)).fits


def test_pipeline_on_300i_duo_is_refused_with_sdma_reason_and_the_tensor_fix(tmp_path):
    path = tmp_path / "pp.yaml"
    path.write_text(open(os.path.join(STRATEGIES, "qwen2_tp4.yaml")).read()
                    .replace("tensor: 4", "tensor: 2").replace("pipeline: 1", "pipeline: 2"))
    plan = make_plan(PRESETS["qwen2-72b"], load_strategy(str(path)), DUO)
    assert not plan.fits and plan.devices == []
    message = plan.errors[0]
    assert "pp.yaml: pipeline: 2" in message and '"sdma error"' in message
    assert "Tensor parallelism through collectives" in message
    assert "set tensor: 4 and pipeline: 1" in message


def test_pipeline_on_p2p_hardware_is_refused_because_msinfer_runs_tensor_and_data_only():
    pp = Strategy(world_size=4, tensor=2, pipeline=2, rules=Strategy.default().rules,
                  source="pp.yaml")
    plan = make_plan(PRESETS["qwen2-7b"], pp, get_profile("atlas-800i-a2"))
    assert plan.errors == ["pp.yaml: pipeline: 2: msinfer runs tensor and data parallelism "
                           "only; set tensor: 4 and pipeline: 1"]


def test_bfloat16_on_310p_is_refused_with_the_float16_fix():
    plan = plan_for("qwen2-7b", "qwen2_tp2.yaml", dtype="bfloat16")
    assert not plan.fits
    assert "cannot run bfloat16: the Ascend 310P chip has no bfloat16" in plan.errors[0]
    assert "Use --dtype float16 or leave --dtype out" in plan.errors[0]


def test_more_devices_than_one_300i_duo_server_is_refused():
    plan = make_plan(PRESETS["qwen2-72b"], Strategy.default(tensor=16), DUO)
    assert "world_size: 16 needs more than one server (8 devices each)" in plan.errors[0]


def test_tp4_refuses_0_5b_because_14_heads_in_the_plan():
    plan = plan_for("qwen2-0.5b", "qwen2_tp4.yaml")
    assert not plan.fits
    assert "14 / 4 = 3.5 heads per rank" in plan.errors[0]


def test_check_plan_or_raise_raises_the_first_error():
    with pytest.raises(PlanRefused, match="does not fit"):
        check_plan_or_raise(PRESETS["qwen2-72b"], strategy("qwen2_tp2.yaml"), DUO)
    assert check_plan_or_raise(PRESETS["qwen2-72b"], strategy("qwen2_tp4.yaml"), DUO).fits


def test_cpu_ranks_share_the_host_memory():
    cpu = get_profile("cpu")
    plan = make_plan(PRESETS["qwen2-0.5b"], strategy("qwen2_tp2.yaml"), cpu)
    assert plan.dtype == "float32"
    assert plan.devices[0].capacity_bytes == cpu.usable_bytes // 2


def test_dtype_policy():
    assert compute_dtype(get_profile("cpu"), "bfloat16")[0] == "float32"
    assert compute_dtype(DUO, "bfloat16")[0] == "float16"
    assert compute_dtype(get_profile("atlas-300i-duo-48g"), "torch.bfloat16")[0] == "float16"
    assert compute_dtype(get_profile("atlas-800i-a2"), "bfloat16")[0] == "bfloat16"
    assert compute_dtype(get_profile("atlas-800i-a2"), "float16")[0] == "float16"
    dtype, reason = compute_dtype(get_profile("cpu"), "bfloat16", requested="float16")
    assert dtype == "float16" and "11x slower" in reason
    with pytest.raises(PlanRefused, match="bfloat16 matmul fails"):
        compute_dtype(get_profile("cpu"), "float32", requested="bfloat16")
    with pytest.raises(MsinferError, match="--dtype 'int4' is not one of"):
        compute_dtype(DUO, "bfloat16", requested="int4")


def test_unknown_hardware_lists_the_known_profiles():
    with pytest.raises(MsinferError, match="unknown hardware 'a100'; known: atlas-300i-duo, "
                                           "atlas-300i-duo-48g, atlas-800i-a2, cpu"):
        get_profile("a100")


def run_cli(monkeypatch, capsys, *args):
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("plan",))
    code = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_prints_the_contract_fields_and_exits_0_when_it_fits(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "--model", "qwen2-72b", "--strategy",
                           os.path.join(STRATEGIES, "qwen2_tp8.yaml"), "--hardware",
                           "atlas-300i-duo", "--json")
    result = json.loads(out)
    assert code == 0 and result["fits"] is True and result["dtype"] == "float16"
    assert {"rank", "weights_bytes", "kv_cache_bytes", "workspace_bytes", "total_bytes",
            "capacity_bytes"} <= set(result["devices"][0])
    assert {"kind", "count", "payload_bytes"} <= set(result["collectives_per_token"][0])
    assert result["errors"] == [] and isinstance(result["warnings"], list)
    assert result["decode_tokens_per_s_bound"] > 0


def test_cli_exits_1_when_it_does_not_fit(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "--model", "qwen2-72b", "--strategy",
                           os.path.join(STRATEGIES, "qwen2_tp2.yaml"), "--hardware",
                           "atlas-300i-duo")
    assert code == 1 and "REFUSED" in out
    assert "with tensor: 4 (world_size 4) it fits" in " ".join(out.split())  # the text is wrapped


def test_cli_exits_2_for_bad_input(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("world_size: 2\ntensor: 2\nrules: {lm_head: colwize}\n")
    code, _, err = run_cli(monkeypatch, capsys, "--model", "qwen2-7b", "--strategy", str(bad),
                           "--hardware", "atlas-300i-duo")
    assert code == 2 and "bad.yaml: rules.lm_head: unknown style 'colwize'" in err


def test_cli_reads_a_model_directory(monkeypatch, capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "torch_dtype": "float32", "tie_word_embeddings": True}))
    code, out, _ = run_cli(monkeypatch, capsys, "--model", str(tmp_path), "--strategy",
                           os.path.join(STRATEGIES, "qwen2_tp2.yaml"), "--hardware", "cpu",
                           "--max-len", "64", "--json")
    result = json.loads(out)
    # tied: embedding (64 x 32) split in two; per layer q, k, v (with biases), o, mlp; norms.
    per_layer = (32 * 32 + 32 + 2 * (16 * 32 + 16) + 32 * 32 + 3 * 48 * 32) // 2 + 2 * 32
    assert code == 0
    assert result["devices"][1]["weights_bytes"] == 4 * (64 * 32 // 2 + 2 * per_layer + 32)


@pytest.mark.parametrize("name", ["qwen2_tp4.yaml", "qwen2_tp8.yaml"])
def test_docs_show_the_real_plan_output_for_72b(name):
    docs = os.path.join(os.path.dirname(STRATEGIES), "docs", "strategies.md")
    with open(docs) as f:
        text = f.read()
    plan = plan_for("qwen2-72b", name)
    plan.strategy = f"strategies/{name}"  # as run from the repository root
    assert format_plan(plan) in text


# ---- the parallel mode: explicit unless asked, and semi_auto's limits refused up front ----

def test_the_planner_plans_the_explicit_mode_unless_asked_and_says_so():
    plan = plan_for("qwen2-1.5b", "qwen2_tp4.yaml")
    assert plan.fits and plan.parallel_mode == "explicit"  # on Ascend too
    assert "4 devices, explicit mode" in format_plan(plan)
    assert plan_for("qwen2-7b", "qwen2_tp4.yaml", parallel_mode="semi_auto").fits


def test_semi_auto_with_replicated_kv_heads_is_refused_by_the_planner():
    plan = plan_for("qwen2-1.5b", "qwen2_tp4.yaml", parallel_mode="semi_auto")
    assert not plan.fits and plan.parallel_mode == "semi_auto"
    assert "tensor=4 exceeds the 2 KV heads" in plan.errors[0]
    with pytest.raises(PlanRefused, match="only in the explicit mode"):
        check_plan_or_raise(load_config("qwen2-1.5b"), strategy("qwen2_tp4.yaml"), DUO,
                            parallel_mode="semi_auto")


def test_semi_auto_on_cpu_is_refused_for_several_ranks_only():
    plan = plan_for("qwen2-0.5b", "qwen2_tp2.yaml", hardware="cpu", parallel_mode="semi_auto")
    assert not plan.fits and "semi_auto needs Ascend or GPU" in plan.errors[0]
    # One rank is MindSpore's stand-alone mode, where shard() is ignored: it runs on CPU.
    assert plan_for("qwen2-0.5b", "qwen2_tp1.yaml", hardware="cpu", max_len=256,
                    parallel_mode="semi_auto").fits


def test_cli_takes_the_parallel_mode(monkeypatch, capsys):
    args = ("--model", "qwen2-1.5b", "--strategy", os.path.join(STRATEGIES, "qwen2_tp4.yaml"),
            "--hardware", "atlas-300i-duo")
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--parallel-mode", "semi_auto")
    assert code == 1 and "REFUSED" in out and "parallel mode semi_auto" in out


def test_llm_runs_the_plan_check_itself_before_touching_a_device(small_checkpoint):
    """Every entry point is checked, not only `msinfer launch`: an LLM whose KV cache cannot
    fit is refused with the planner's message, before any graph or collective exists."""
    pytest.importorskip("mindspore")
    from msinfer import LLM

    with pytest.raises(PlanRefused, match="does not fit: rank 0 needs"):
        LLM(small_checkpoint, max_num_seqs=100_000, max_len=4096)


def test_plan_takes_tensor_parallel_size_for_the_shipped_strategy(capsys):
    """`msinfer plan -tp 4` plans what `--strategy strategies/qwen2_tp4.yaml` does."""
    from msinfer.cli.main import main

    reports = []
    for placement in (["--tensor-parallel-size", "4"], ["--strategy", os.path.join(
            STRATEGIES, "qwen2_tp4.yaml")]):
        code = main(["plan", "--model", "qwen2-72b", "--hardware", "atlas-300i-duo", "--json",
                     *placement])
        report = json.loads(capsys.readouterr().out)
        reports.append({k: v for k, v in report.items() if k != "strategy"})
        assert code == 0
    assert reports[0] == reports[1]
    assert main(["plan", "--model", "qwen2-72b", "--hardware", "cpu"]) == 2
    assert "give --strategy FILE or --tensor-parallel-size N" in capsys.readouterr().err


def test_a_draft_model_shares_each_device_with_its_weights_and_kv_cache(small_checkpoint):
    """Speculative decoding's draft runs whole on every rank: its weights, and a KV cache of
    as many blocks as the target's, are counted on each device, and the target's pool is
    smaller by the draft's share of each block; static graphs are refused."""
    from msinfer.speculative_config import SpeculativeConfig

    config = load_config("qwen2-7b")
    limits = EngineLimits.for_model(config, max_model_len=32768, max_num_seqs=64)
    plain = make_plan(config, strategy("qwen2_tp2.yaml"), DUO, limits)
    draft_config = load_config(small_checkpoint)
    spec = SpeculativeConfig(method="draft_model", model=small_checkpoint)
    drafted = make_plan(config, strategy("qwen2_tp2.yaml"), DUO, limits, speculative=spec)
    assert not plain.errors and not drafted.errors
    draft_weights = sum(2 * (s[0] * (s[1] if len(s) > 1 else 1))  # float16 on the 310P
                        for s in draft_config.parameter_shapes().values())
    draft_block = block_bytes(draft_config.num_layers, draft_config.num_kv_heads,
                              head_dim=draft_config.head_dim)
    target_block = block_bytes(28, 2, head_dim=128)  # 4 KV heads over 2 ranks
    for before, after in zip(plain.devices, drafted.devices):
        assert after.weights_bytes == before.weights_bytes + draft_weights
        blocks = drafted.kv_blocks + 1
        assert after.kv_cache_bytes == blocks * (target_block + draft_block)
        # the same budget, now shared by both caches' blocks (the verification's logits
        # rows, max_prefill_tokens, enlarge the workspace)
        assert after.workspace_bytes >= before.workspace_bytes
    assert drafted.kv_blocks < plain.kv_blocks
    static = make_plan(config, strategy("qwen2_tp2.yaml"), DUO,
                       EngineLimits.for_model(config, graph_shapes="static"),
                       speculative=SpeculativeConfig(method="ngram"))
    assert "graph_shapes dynamic" in static.errors[0]
