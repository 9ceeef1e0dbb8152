"""Mixture-of-experts models: Qwen3-MoE and Qwen2-MoE against Hugging Face transformers' own
Qwen3MoeForCausalLM and Qwen2MoeForCausalLM, on one rank, on two (experts sharded along their
width, and whole experts per rank), and through the OpenAI server; the sparse layer's forms
(the C++ kernel, and the MindSpore forms where g++ is missing) against a numpy reference under
skewed routing; the planner's and the loader's refusals.

The checkpoints are written by transformers' classes (save_pretrained: experts per expert on
disk) with tools.tiny_model's random values (peaked logits, clear router choices): Qwen3-MoE
with layer 1 dense through mlp_only_layers, 8 experts, top-2, renormalised, untied; Qwen2-MoE
with a shared expert and its sigmoid gate, qkv biases, top-2 not renormalised. Routing near a
tie could pick different experts on two implementations whose activations differ by 1e-7:
`test_the_routers_choices_are_clear` measures the gap at every routing these prompts make.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_distributed import (check_ranks_against_hf, mpirun_prefix,  # noqa: E402
                              run_job, worker_args)
from test_parity import (ENGINE, NEW_TOKENS, assert_matches_hf, greedy,  # noqa: E402
                         prompts_for)

from msinfer import LLM, SamplingParams  # noqa: E402
from msinfer.config import PRESETS, ModelConfig  # noqa: E402
from msinfer.errors import MsinferError, PlanRefused  # noqa: E402
from msinfer.parallel.strategy import Strategy, load_strategy  # noqa: E402
from msinfer.tools.tiny_model import random_tensor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGIES = os.path.join(ROOT, "strategies")
COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, moe_intermediate_size=32, num_experts=8,
              num_experts_per_tok=2, max_position_embeddings=128, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=0,
              eos_token_id=1, tie_word_embeddings=False)
# (config class, model class, its arguments, the random values' seed: one whose routing of
# these prompts has clear gaps, test_the_routers_choices_are_clear; Qwen2-MoE's seed 1 had one
# of 4e-5, its seed 2 has none below 5e-4)
CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
                       head_dim=32), 1),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_hidden_layers=2, shared_expert_intermediate_size=48), 2),
}


def make_hf_moe(path, name, seed=None):
    config_class, model_class, extra, case_seed = CASES[name]
    seed = case_seed if seed is None else seed
    config = getattr(transformers, config_class)(**COMMON, **extra)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.copy_(torch.from_numpy(random_tensor(param_name, tuple(param.shape), seed)))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory):
    """{name: (directory, ModelConfig, transformers' model on it in float32)}."""
    made = {}
    for name in CASES:
        path = make_hf_moe(str(tmp_path_factory.mktemp(name) / "model"), name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        made[name] = (path, ModelConfig.from_model_dir(path), hf)
    return made


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, moe_checkpoints):
    path, config, hf = moe_checkpoints[request.param]
    return request.param, config, LLM(path, **ENGINE), hf


def test_checkpoints_are_transformers_moe_with_experts_per_expert_on_disk(case):
    name, config, llm, hf = case
    assert type(hf).__name__ == CASES[name][1] and config.model_type == name
    assert config.moe.num_experts == 8 and config.moe.num_experts_per_tok == 2
    with open(os.path.join(llm.model_dir, "config.json")) as f:
        raw = json.load(f)
    # transformers 5 spells Qwen3-MoE's expert count num_local_experts, Qwen2-MoE's num_experts
    assert ("num_local_experts" in raw) == (name == "qwen3_moe")
    sparse = [n for n in range(config.num_layers) if config.is_sparse_layer(n)]
    assert sparse == ([0, 2] if name == "qwen3_moe" else [0, 1])
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in config.parameter_shapes()
    assert config.moe.norm_topk_prob == (name == "qwen3_moe")
    assert bool(config.moe.shared_expert_intermediate) == (name == "qwen2_moe")


def test_the_routers_choices_are_clear(case):
    """At every token and sparse layer of these prompts and transformers' greedy tokens, the
    k-th expert's probability exceeds the (k+1)-th's by far more than the two
    implementations' activations differ (~1e-6)."""
    name, config, llm, hf = case
    gaps = []

    def hook(module, args, output):
        probs = torch.softmax(output[0].float(), -1).sort(-1, descending=True).values
        k = config.moe.num_experts_per_tok
        gaps.append((probs[:, k - 1] - probs[:, k]).min().item())

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in hf.model.layers
               if hasattr(layer.mlp, "gate") and not hasattr(layer.mlp, "gate_proj")]
    try:
        for prompt in prompts_for(config.vocab_size):
            with torch.no_grad():
                hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    finally:
        for handle in handles:
            handle.remove()
    assert len(handles) == 2 and gaps  # Qwen3-MoE: layers 0 and 2; Qwen2-MoE: 0 and 1
    assert min(gaps) > 1e-4, f"a near-tie in routing: {min(gaps)}"


def test_logprobs_and_32_greedy_tokens_match_transformers(case):
    """Prompts of 5, 11, 37 (three 16-token prefill chunks: the grouped form) and 1 token;
    decode steps of up to 4 sequences (the by-token form)."""
    name, config, llm, hf = case
    prompts = prompts_for(config.vocab_size)
    outs = llm.generate(prompts, greedy(config.vocab_size))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert len(out.token_ids) == NEW_TOKENS
        assert_matches_hf(hf, prompt, out, config.vocab_size, f"{name} prompt {i}")
    assert llm.engine.stats().num_blocks_used == 0


def test_a_shared_prefix_is_reused_and_still_matches_transformers(case):
    name, config, llm, hf = case
    first, second = prompts_for(config.vocab_size, seed=3, lengths=(24, 6))
    hits = llm.engine.stats().prefix_cache_hits
    llm.generate([first], greedy(config.vocab_size, 4))
    out = llm.generate([first[:20] + second], greedy(config.vocab_size, 12))[0]
    assert llm.engine.stats().prefix_cache_hits > hits
    assert_matches_hf(hf, first[:20] + second, out, config.vocab_size, f"{name} prefix")


def test_float16_compute_the_310p_path_gives_the_same_greedy_tokens(case):
    """Routing in float32 from float16 logits, the experts in float16 (casts in both forms)."""
    name, config, llm, hf = case
    # two prompts, one of two chunks: float16 matmul is ~11x slower than float32 on CPU
    prompts = prompts_for(config.vocab_size, seed=2, lengths=(5, 21))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    half = LLM(llm.model_dir, dtype="float16", **ENGINE)
    assert [o.token_ids for o in half.generate(prompts, params)] == [
        o.token_ids for o in llm.generate(prompts, params)]


def test_the_engine_runs_this_hosts_forms_and_a_stack_per_run_of_layer_kinds(case):
    """The C++ kernel for every call where g++ builds it; else the grouped form for prefill
    chunks and the by-token one for decode."""
    from msinfer.layers.moe import SparseMoE, uses_cpu_kernel

    name, config, llm, hf = case
    runner = llm.engine.runner
    forms = {"kernel" if cell.kernel is not None else "grouped" if cell.grouped else "by_token"
             for stack in runner.cells.values()
             for _, cell in stack.cells_and_names() if isinstance(cell, SparseMoE)}
    assert forms == ({"kernel"} if uses_cpu_kernel() else {"grouped", "by_token"})
    held = dict(zip([f"model.layers.0.{w}" for w in runner.layer_classes[0].WEIGHTS],
                    runner.layer_weights[0]))
    experts = held["model.layers.0.mlp.experts.gate_up_proj.weight"]
    assert tuple(experts.shape) == (8, 2 * 32, 64)  # gate rows first, as transformers fuses
    fused = hf.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(experts.asnumpy(), fused)
    kinds = [layer.__name__ for layer in runner.layer_classes]
    assert kinds == (["SparseLayer", "DenseLayer", "SparseLayer"] if name == "qwen3_moe"
                     else ["SparseLayer", "SparseLayer"])


# ---- the sparse layer against numpy ----

def reference_moe(x, router, gate_up, down, k, renormalise):
    """HF's routing and expert sum in numpy (float64)."""
    logits = x @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, -1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, -1)
    if renormalise:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(len(x)):
        for e, w in zip(ids[t], weights[t]):
            gate, up = np.split(gate_up[e] @ x[t], 2)
            out[t] += w * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


@pytest.mark.parametrize("rows,skewed,tensor,kernel", [
    (24, True, 1, False), (24, False, 1, False), (3, True, 1, False), (24, False, 2, False),
    (24, True, 1, True), (3, False, 2, True)])
def test_the_sparse_layer_sums_each_tokens_routed_experts_whatever_the_routing(
        rows, skewed, tensor, kernel, monkeypatch):
    """24 rows x top-3 of 6 experts: the grouped form (pairs > experts), every token routed to
    experts 0-2 when skewed (the worst case for one expert's run); 3 rows: by token; kernel:
    the C++ kernel instead, as where g++ is (else the MindSpore forms, as where it is not).
    tensor 2: rank 1 of expert parallelism (experts 3-5), whose partial sum holds only its
    experts'."""
    import mindspore as ms
    from mindspore import Tensor

    from msinfer import hardware
    from msinfer.layers import moe
    from msinfer.layers.moe import SparseMoE
    from msinfer.layers.parallel_context import ParallelContext
    from msinfer.parallel.distributed import set_graph_mode
    from msinfer.planning.shapes import Graph

    raw = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=32,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
               num_experts=6, num_experts_per_tok=3, moe_intermediate_size=8,
               norm_topk_prob=True)
    config = ModelConfig.from_dict(raw)
    rules = {**Strategy.default().rules, **{f"model.layers.*.mlp.experts.*.{p}": "expert"
                                            for p in ("gate_proj", "up_proj", "down_proj")}}
    plan = Strategy(world_size=tensor, tensor=tensor, rules=rules).resolve(config)
    set_graph_mode("CPU")
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    router = rng.standard_normal((6, 16)).astype(np.float32)
    if skewed:  # experts 0-2 score far above the others for every token
        common = np.ones(16, np.float32) / 4
        x += 3 * common
        router[:3] = 4 * common + router[:3] * 0.1
        router[3:] *= 0.1
    gate_up = rng.standard_normal((6, 16, 16)).astype(np.float32) / 4
    down = rng.standard_normal((6, 16, 8)).astype(np.float32) / 3
    rank = tensor - 1
    ctx = ParallelContext(config=config, plan=plan, tensor_rank=rank, dtype=ms.float32,
                          graph=Graph("layers", "prefill", 1, rows=rows))
    if kernel and not hardware.kernel_compiler_available():
        pytest.skip("no g++")
    monkeypatch.setattr(moe, "uses_cpu_kernel", lambda device_target=None: kernel)
    layer = SparseMoE(ctx, "model.layers.0.mlp")
    layer.reduce = None  # one rank's partial sum, with no job to sum it over
    assert (layer.kernel is not None) == kernel
    assert layer.grouped == (not kernel and rows * 3 > 6)
    held = list(plan.local_experts("model.layers.0.mlp.experts.gate_up_proj.weight", rank))
    down_in_out = np.ascontiguousarray(down[held].transpose(0, 2, 1))  # as loaded
    got = layer(Tensor(x), Tensor(router), Tensor(gate_up[held]), Tensor(down_in_out)).asnumpy()
    routed = reference_moe(x.astype(np.float64), router, gate_up, down, 3, True)
    if tensor > 1:  # rank 1's part: the other experts' weights zeroed
        others = [e for e in range(6) if e not in held]
        zeroed = down.copy()
        zeroed[others] = 0
        routed = reference_moe(x.astype(np.float64), router, gate_up, zeroed, 3, True)
    np.testing.assert_allclose(got, routed, rtol=1e-4, atol=1e-5)



def test_ascend_runs_the_experts_by_moe_primitives_and_cpu_by_its_own_forms(monkeypatch):
    """The Ascend form cannot run here (no kernels on CPU): what it decides is checked. The
    Ascend profiles pick it, CPU does not; it calls MoeInitRoutingV2, GroupedMatmul and
    MoeTokenUnpermute with arguments their installed signatures take; and with numpy stand-ins
    written from their documentation, its bookkeeping (casts, cumulative run ends, the gate/up
    layout weight_layout gives it, the routing weights) sums each token's routed experts."""
    import inspect

    import mindspore as ms
    from mindspore import Tensor

    from msinfer.hardware import PROFILES
    from msinfer.layers import moe
    from msinfer.layers.parallel_context import ParallelContext
    from msinfer.models import moe_family

    assert [p for p in PROFILES if moe.uses_moe_primitives(PROFILES[p].device_target)] == [
        "atlas-300i-duo", "atlas-300i-duo-48g", "atlas-800i-a2"]
    assert not moe.uses_moe_primitives()  # this process: CPU

    raw = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=32,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
               num_experts=6, num_experts_per_tok=3, moe_intermediate_size=8,
               norm_topk_prob=True)
    config = ModelConfig.from_dict(raw)
    plan = Strategy(world_size=1, tensor=1, rules=Strategy.default().rules).resolve(config)
    ctx = ParallelContext(config=config, plan=plan, dtype=ms.float32)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    router = rng.standard_normal((6, 16)).astype(np.float32)
    gate_up = rng.standard_normal((6, 16, 16)).astype(np.float32) / 4
    down = rng.standard_normal((6, 16, 8)).astype(np.float32) / 3
    calls = []

    def stand_in(real, compute):
        def call(*args, **kwargs):
            bound = inspect.signature(real).bind(*args, **kwargs)  # TypeError if unfit
            bound.apply_defaults()
            calls.append(real.__name__)
            return compute(**{k: v.asnumpy() if isinstance(v, Tensor) else v
                              for k, v in bound.arguments.items()})
        return call

    def init_routing(x, expert_idx, active_num, expert_capacity, expert_num, drop_pad_mode,
                     expert_tokens_count_or_cumsum_flag, expert_tokens_before_capacity_flag):
        assert (active_num, drop_pad_mode, expert_tokens_count_or_cumsum_flag) == (0, 0, 1)
        assert expert_idx.dtype == np.int32
        pairs = expert_idx.reshape(-1)
        order = np.argsort(pairs, kind="stable")  # pair order[j] is row j
        row_of_pair = np.empty_like(order)
        row_of_pair[order] = np.arange(len(order))
        ends = np.cumsum(np.bincount(pairs, minlength=expert_num))
        k = expert_idx.shape[1]
        return (Tensor(x[order // k]), Tensor(row_of_pair.astype(np.int32)),
                Tensor(ends.astype(np.int32)))

    def grouped(x, weight, group_list, split_item, group_type, transpose_b, **_):
        assert (split_item, group_type, transpose_b) == (3, 0, False)
        assert group_list.dtype == np.int64
        (x,), (w,) = [t.asnumpy() for t in x], [t.asnumpy() for t in weight]
        starts = np.concatenate([[0], group_list[:-1]])
        y = np.concatenate([x[s:e] @ w[n] for n, (s, e) in enumerate(zip(starts, group_list))])
        return [Tensor(y)]

    def unpermute(permuted_tokens, sorted_indices, probs, **_):
        k = probs.shape[1]
        rows = permuted_tokens[sorted_indices].reshape(len(probs), k, -1)
        return Tensor((rows * probs[..., None]).sum(1))

    monkeypatch.setattr(moe, "uses_moe_primitives", lambda device_target=None: True)
    monkeypatch.setattr(moe, "moe_init_routing_v2",
                        stand_in(moe.moe_init_routing_v2, init_routing))
    monkeypatch.setattr(moe, "grouped_matmul", stand_in(moe.grouped_matmul, grouped))
    monkeypatch.setattr(moe, "moe_token_unpermute",
                        stand_in(moe.moe_token_unpermute, unpermute))
    monkeypatch.setattr(moe_family, "uses_moe_primitives", moe.uses_moe_primitives)
    layer = moe.SparseMoE(ctx, "model.layers.0.mlp")
    assert layer.primitives is not None and not layer.grouped
    stacked = "model.layers.0.mlp.experts.gate_up_proj.weight"
    held_gate_up = moe_family.weight_layout(ctx, stacked, gate_up.reshape(-1, 16))
    assert held_gate_up.shape == (6, 16, 16) and np.array_equal(held_gate_up[2], gate_up[2].T)
    down_in_out = np.ascontiguousarray(down.transpose(0, 2, 1))  # as loaded
    weights, ids = layer._route(Tensor(x), Tensor(router))
    got = layer.primitives.construct(Tensor(x), weights, ids, Tensor(held_gate_up),
                                     Tensor(down_in_out)).asnumpy()
    assert calls == ["moe_init_routing_v2", "grouped_matmul", "grouped_matmul",
                     "moe_token_unpermute"]
    np.testing.assert_allclose(got, reference_moe(x.astype(np.float64), router, gate_up, down,
                                                  3, True), rtol=1e-4, atol=1e-5)

# ---- two ranks ----

@pytest.fixture(scope="module")
def tp2_job(moe_checkpoints, tmp_path_factory):
    """One mpirun job of 2 ranks: Qwen3-MoE with experts sharded along their width
    (strategies/moe/tp2.yaml), then Qwen2-MoE with whole experts per rank
    (strategies/moe/ep2.yaml), its shared expert still split along its width and its partial
    sums in the experts' AllReduce. Each placement once and each family once: the other two
    pairings run the same layer code (a run of a model costs about as much as a job start)."""
    out_dir = tmp_path_factory.mktemp("moe_tp2")
    qwen3, qwen2 = moe_checkpoints["qwen3_moe"][0], moe_checkpoints["qwen2_moe"][0]
    cmd = (mpirun_prefix(2) + [sys.executable]
           + worker_args(qwen3, "moe/tp2.yaml", out_dir)
           + ["--model2", qwen2, "--model2-new-tokens", "9",
              "--model2-strategy", os.path.join(STRATEGIES, "moe/ep2.yaml")])
    code, out, _ = run_job(cmd)
    assert code == 0, out[-3000:]
    return out_dir


@pytest.mark.multirank(ranks=2)
@pytest.mark.parametrize("name,results,strategy", [
    ("qwen3_moe", "npz", "tp2"), ("qwen2_moe", "model2.npz", "ep2")])
def test_two_ranks_match_transformers_holding_what_the_plan_says(moe_checkpoints, tp2_job,
                                                                 name, results, strategy):
    from msinfer.hardware import get_profile
    from msinfer.engine_config import EngineLimits
    from msinfer.planning.planner import make_plan

    path, config, hf = moe_checkpoints[name]
    ranks = check_ranks_against_hf(tp2_job, 2, hf, "mpirun-bridge", results=results)
    limits = EngineLimits.for_model(config, max_len=128, block_size=4, max_prefill_tokens=16,
                                    kv_cache_memory=1 << 20)
    report = make_plan(config, load_strategy(os.path.join(STRATEGIES, f"moe/{strategy}.yaml")),
                       get_profile("cpu"), limits)
    assert [int(r["param_bytes"]) for r in ranks] == [d.weights_bytes for d in report.devices]
    full_bytes = sum(p.numel() for p in hf.parameters()) * 4
    assert all(int(r["param_bytes"]) < 0.62 * full_bytes for r in ranks)


# ---- the OpenAI server ----

@pytest.mark.server
def test_a_moe_model_serves_a_completion_as_the_offline_engine_and_transformers(tmp_path):
    from servers import SERVE_ARGS, ServerProcess

    from msinfer.tools.tiny_model import make_tiny_model

    model_dir = str(tmp_path / "model")
    make_tiny_model(model_dir, family="qwen3", layers=2, hidden=64, heads=4, kv_heads=2,
                    vocab=384, seed=3, moe=dict(experts=8, top_k=2, mlp_only_layers=(1,)))
    prompt = prompts_for(384, seed=11, lengths=(9,))[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=384)
    offline = LLM(model_dir, max_len=128, max_num_seqs=4, max_prefill_tokens=32)
    expected = offline.generate([prompt], params)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                           dtype=torch.float32).eval()
    assert_matches_hf(hf, prompt, expected, 384, "offline")
    server = ServerProcess(["serve", "--model", model_dir] + SERVE_ARGS,
                           str(tmp_path / "server.log"))
    try:
        reply = server.client().completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True})
    finally:
        server.kill()
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == 8


# ---- refusals and the planner ----

def _raw(**changes):
    raw = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
               num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8)
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_both_spellings_of_the_expert_count_read_alike():
    spelled = ModelConfig.from_dict(_raw(num_experts=None, num_local_experts=6))
    assert spelled.moe == ModelConfig.from_dict(_raw()).moe
    with pytest.raises(MsinferError, match="missing num_experts"):
        ModelConfig.from_dict(_raw(num_experts=None))
    with pytest.raises(MsinferError, match="num_experts_per_tok=8 exceeds num_experts=6"):
        ModelConfig.from_dict(_raw(num_experts_per_tok=8))


def test_an_expert_parallel_degree_that_does_not_divide_the_experts_is_refused():
    config = ModelConfig.from_dict(_raw())
    ep = load_strategy(os.path.join(STRATEGIES, "moe/ep2.yaml"))
    assert len(ep.resolve(config).local_experts("model.layers.0.mlp.experts.gate_up_proj."
                                                "weight", 1)) == 3
    ep4 = Strategy(world_size=4, tensor=4, rules=ep.rules, source="ep4.yaml")
    with pytest.raises(PlanRefused, match=r"ep4.yaml: tensor: 4 cannot shard .*expert "
                                          r"parallel: the 6 experts do not split into 4 ranks"):
        ep4.resolve(ModelConfig.from_dict(_raw(num_attention_heads=4, num_key_value_heads=4)))
    tp4 = load_strategy(os.path.join(STRATEGIES, "moe/tp4.yaml"))
    with pytest.raises(PlanRefused, match="moe_intermediate_size does not split: 6 / 4"):
        tp4.resolve(ModelConfig.from_dict(_raw(num_attention_heads=4, num_key_value_heads=4,
                                               moe_intermediate_size=6)))


def test_a_strategy_without_expert_rules_or_in_semi_auto_is_refused():
    config = ModelConfig.from_dict(_raw())
    with pytest.raises(MsinferError, match=r"no rule covers model.layers.0.mlp.gate and .*"
                                           r"'model.layers.\*.mlp.gate: replicate'"):
        load_strategy(os.path.join(STRATEGIES, "qwen2_tp2.yaml")).resolve(config)
    mixed = dict(load_strategy(os.path.join(STRATEGIES, "moe/tp2.yaml")).rules)
    mixed["model.layers.*.mlp.experts.*.down_proj"] = "expert"
    with pytest.raises(MsinferError, match="mlp.experts.* has gate_proj colwise, up_proj "
                                           "colwise, down_proj expert"):
        Strategy(world_size=2, tensor=2, rules=mixed).resolve(config)
    with pytest.raises(PlanRefused, match="mixture-of-experts model .* only in the explicit"):
        Strategy.default().resolve(config, "semi_auto")


def test_a_checkpoint_missing_an_experts_tensor_is_refused_naming_it(moe_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    source = moe_checkpoints["qwen2_moe"][0]
    for name in os.listdir(source):
        if name.endswith(".json"):
            with open(os.path.join(source, name)) as f, open(tmp_path / name, "w") as g:
                g.write(f.read())
    tensors = load_file(os.path.join(source, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MsinferError, match=r"checkpoint lacks 1 tensor\(s\) the model needs, "
                                           r"first: model.layers.1.mlp.experts.5.up_proj.weight"):
        LLM(str(tmp_path), **ENGINE)


def test_plan_shows_qwen3_30b_a3b_on_one_300i_duo_card():
    """tp2: the card's two 310P chips; the decode bound from the active parameters."""
    out = subprocess.run(
        [sys.executable, "-m", "msinfer", "plan", "--model", "qwen3-30b-a3b", "--strategy",
         os.path.join(STRATEGIES, "moe", "tp2.yaml"), "--hardware", "atlas-300i-duo"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "FITS" in out.stdout and "experts 48" in out.stdout
    assert "3.35B of 30.53B parameters" in " ".join(out.stdout.split())
    for name, billions in (("qwen3-30b-a3b", 30.5), ("qwen2-57b-a14b", 57.4)):
        assert round(PRESETS[name].num_parameters() / 1e9, 1) == billions


def test_the_planner_counts_the_graphs_the_engine_compiles(case):
    """A stack's graph per run of layer kinds: Qwen3-MoE's sparse, dense, sparse layers."""
    from msinfer.hardware import get_profile
    from msinfer.engine_config import EngineLimits
    from msinfer.planning.planner import make_plan

    name, config, llm, hf = case
    limits = EngineLimits.for_model(config, max_len=128, block_size=4, max_prefill_tokens=16,
                                    max_num_seqs=4, kv_cache_memory=1 << 20)
    report = make_plan(config, Strategy.default(), get_profile("cpu"), limits)
    assert report.warmup_graphs == llm.engine.runner.graph_count
