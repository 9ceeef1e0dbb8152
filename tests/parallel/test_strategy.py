import os

import numpy as np
import pytest

from msinfer.config import PRESETS, ModelConfig
from msinfer.errors import MsinferError, PlanRefused
from msinfer.parallel.strategy import (TENSOR_PARALLEL_RULES, Strategy, decide_parallel_mode,
                                       load_strategy)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGIES = os.path.join(ROOT, "strategies")
SHIPPED = ["qwen2_tp1.yaml", "qwen2_tp2.yaml", "qwen2_tp4.yaml", "qwen2_tp8.yaml",
           "qwen2_dp2_tp2.yaml"]


def tiny(tie=False, heads=4, kv_heads=2):
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=8,
                       tie_word_embeddings=tie, source="tiny")


def write(tmp_path, text, name="s.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def rules_yaml(rules):
    return "rules:\n" + "".join(f"  {p}: {s}\n" for p, s in rules.items())


def strategy_file(tmp_path, tensor=4, data=1, extra="", **overrides):
    rules = dict(TENSOR_PARALLEL_RULES, **overrides)
    head = f"world_size: {tensor * data}\ntensor: {tensor}\ndata: {data}\n{extra}"
    return write(tmp_path, head + rules_yaml(rules))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_strategy_explains_itself_and_holds_the_tensor_parallel_rules(name):
    path = os.path.join(STRATEGIES, name)
    with open(path) as f:
        assert f.readline().startswith("# ")
    strategy = load_strategy(path)
    assert strategy.rules == TENSOR_PARALLEL_RULES
    assert strategy.tensor * strategy.data * strategy.pipeline == strategy.world_size
    assert strategy.source == path


def test_shipped_strategies_have_the_degrees_their_names_say():
    degrees = {n: load_strategy(os.path.join(STRATEGIES, n)) for n in SHIPPED}
    assert [(s.tensor, s.data) for s in degrees.values()] == [(1, 1), (2, 1), (4, 1), (8, 1),
                                                               (2, 2)]


def test_unknown_key_is_named_with_the_file_and_a_suggestion(tmp_path):
    path = write(tmp_path, "world_size: 4\ntensr: 4\nrules: {lm_head: replicate}\n")
    with pytest.raises(MsinferError, match=r"s\.yaml: unknown key 'tensr' \(did you mean "
                                           r"'tensor'\?\)"):
        load_strategy(path)


def test_degree_product_different_from_world_size_is_refused(tmp_path):
    path = write(tmp_path, "world_size: 8\ntensor: 2\ndata: 2\nrules: {lm_head: replicate}\n")
    with pytest.raises(MsinferError, match=r"s\.yaml: world_size: 8 is not tensor x data x "
                                           r"pipeline = 2 x 2 x 1 = 4"):
        load_strategy(path)


def test_unknown_style_names_file_key_and_value(tmp_path):
    path = strategy_file(tmp_path, **{"model.layers.*.mlp.up_proj": "colwize"})
    with pytest.raises(MsinferError, match=r"s\.yaml: rules\.model\.layers\.\*\.mlp\.up_proj: "
                                           r"unknown style 'colwize' \(did you mean 'colwise'"):
        load_strategy(path)


def test_non_integer_degree_is_refused(tmp_path):
    path = write(tmp_path, "world_size: 4\ntensor: four\nrules: {lm_head: replicate}\n")
    with pytest.raises(MsinferError, match=r"s\.yaml: tensor: must be a positive integer, "
                                           r"got 'four'"):
        load_strategy(path)


def test_repeated_yaml_key_is_refused_instead_of_silently_overridden(tmp_path):
    path = write(tmp_path, "world_size: 1\ntensor: 1\nrules:\n  lm_head: replicate\n"
                           "  lm_head: colwise_gather\n")
    with pytest.raises(MsinferError, match="duplicate key 'lm_head'"):
        load_strategy(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(MsinferError, match="nope.yaml: cannot read strategy file"):
        load_strategy(str(tmp_path / "nope.yaml"))


def test_pattern_that_matches_no_module_is_refused(tmp_path):
    rules = dict(TENSOR_PARALLEL_RULES)
    rules["model.layers.*.self_attn.q_proj.weight"] = rules.pop("model.layers.*.self_attn.q_proj")
    path = write(tmp_path, "world_size: 2\ntensor: 2\n" + rules_yaml(rules))
    with pytest.raises(MsinferError, match=r"rules\.model\.layers\.\*\.self_attn\.q_proj\.weight: "
                                           r"the pattern matches no module of tiny"):
        load_strategy(path).resolve(tiny())


def test_module_no_rule_covers_is_named_with_a_rule_to_add(tmp_path):
    rules = dict(TENSOR_PARALLEL_RULES)
    del rules["model.layers.*.mlp.down_proj"]
    path = write(tmp_path, "world_size: 2\ntensor: 2\n" + rules_yaml(rules))
    with pytest.raises(MsinferError, match=r"no rule covers model\.layers\.0\.mlp\.down_proj and "
                                           r"1 more; add one, e\.g\. "
                                           r"'model\.layers\.\*\.mlp\.down_proj: rowwise'"):
        load_strategy(path).resolve(tiny())


def test_module_covered_by_two_rules_is_refused(tmp_path):
    path = strategy_file(tmp_path, tensor=2, **{"model.layers.*.self_attn.*_proj": "replicate"})
    with pytest.raises(MsinferError, match="both cover model.layers.0.self_attn.q_proj"):
        load_strategy(path).resolve(tiny())


def test_tp4_refuses_0_5b_because_14_heads(tmp_path):
    with pytest.raises(PlanRefused) as e:
        load_strategy(os.path.join(STRATEGIES, "qwen2_tp4.yaml")).resolve(PRESETS["qwen2-0.5b"])
    message = str(e.value)
    assert "qwen2_tp4.yaml: tensor: 4" in message
    assert "14 attention heads do not split into 4 (14 / 4 = 3.5 heads per rank)" in message
    assert "Tensor degrees that work for this model with these rules: 1, 2" in message


def test_kv_heads_that_neither_split_nor_replicate_evenly_are_refused():
    with pytest.raises(PlanRefused, match=r"the 4 KV heads can neither be split 6 ways "
                                          r"\(4 / 6 = 0\.666667\) nor replicated evenly"):
        Strategy.default(tensor=6).resolve(tiny(heads=12, kv_heads=4))


def test_tp4_replicates_1_5b_kv_heads_on_consecutive_ranks():
    config = PRESETS["qwen2-1.5b"]
    plan = Strategy.default(tensor=4).resolve(config)
    assert plan.kv_replicas == 2 and plan.local_kv_heads == 1 and plan.local_heads == 3
    rows = [plan.slices("model.layers.3.self_attn.k_proj.weight", r)[0] for r in range(4)]
    assert [(s.start, s.stop) for s in rows] == [(0, 128), (0, 128), (128, 256), (128, 256)]
    assert plan.local_shape("model.layers.3.self_attn.v_proj.bias") == (128,)


@pytest.mark.parametrize("tensor,kv_heads", [(1, 2), (2, 2), (4, 2), (8, 2), (2, 4), (4, 1)])
def test_each_rank_holds_the_kv_heads_its_query_heads_use(tensor, kv_heads):
    config = tiny(heads=8, kv_heads=kv_heads)
    plan = Strategy.default(tensor=tensor).resolve(config)
    d = config.head_dim
    for r in range(tensor):
        q = plan.slices("model.layers.0.self_attn.q_proj.weight", r)[0]
        k = plan.slices("model.layers.0.self_attn.k_proj.weight", r)[0]
        held = set(range(k.start // d, k.stop // d))
        used = {head // config.kv_groups for head in range(q.start // d, q.stop // d)}
        assert used == held


def _coverage(plan, name, shape):
    """How many tensor ranks hold each element of a tensor."""
    counts = np.zeros(shape, dtype=np.int64)
    for r in range(plan.tensor):
        counts[plan.slices(name, r)] += 1
    return counts


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_slices_cover_every_weight_exactly_once_per_replica(tensor, tie):
    config = tiny(tie=tie)  # 2 KV heads: tensor 4 replicates each on 2 ranks
    plan = Strategy.default(tensor=tensor, data=2).resolve(config)
    for name, shape in config.parameter_shapes().items():
        counts = _coverage(plan, name, shape)
        style = plan.style(name)
        if style == "replicate":
            expected = tensor
        elif ".k_proj." in name or ".v_proj." in name:
            expected = plan.kv_replicas
        else:
            expected = 1
        assert counts.min() == counts.max() == expected, (name, style)
        if expected == 1 and tensor > 1:
            assert plan.local_shape(name) != tuple(shape)


def test_replicated_attention_and_mlp_are_whole_on_every_rank():
    rules = dict(TENSOR_PARALLEL_RULES)
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        rules[f"model.layers.*.{part}"] = "replicate"
    plan = Strategy(world_size=2, tensor=2, rules=rules).resolve(tiny())
    assert plan.local_shape("model.layers.1.mlp.down_proj.weight") == (32, 48)
    assert plan.kv_replicas == 2 and plan.local_kv_heads == 2
    assert plan.local_shape("model.embed_tokens.weight") == (32, 32)


def test_slices_index_safetensors_get_slice_directly(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    config = tiny()
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32)
               for n, s in config.parameter_shapes().items()}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    plan = Strategy.default(tensor=4).resolve(config)
    with safe_open(path, framework="numpy") as f:
        for name, full in tensors.items():
            for r in range(4):
                local = f.get_slice(name)[plan.slices(name, r)]
                assert local.shape == plan.local_shape(name)
                np.testing.assert_array_equal(local, full[plan.slices(name, r)])


def test_in_strategy_of_each_style_for_shard():
    plan = Strategy.default(tensor=4, data=2).resolve(tiny(heads=8, kv_heads=4))
    layer = "model.layers.0."
    assert plan.in_strategy(layer + "self_attn.q_proj.weight") == ((2, 1), (4, 1))
    assert plan.in_strategy(layer + "self_attn.q_proj.bias") == ((2, 4), (4,))
    assert plan.in_strategy(layer + "self_attn.o_proj.weight") == ((2, 4), (1, 4))
    assert plan.in_strategy(layer + "mlp.down_proj.weight") == ((2, 4), (1, 4))
    assert plan.in_strategy("model.embed_tokens.weight") == ((4, 1), (1,))
    assert plan.in_strategy("lm_head.weight") == ((2, 1), (4, 1))
    with pytest.raises(MsinferError, match="norm weight is replicated and applied element-wise"):
        plan.in_strategy(layer + "input_layernorm.weight")


def test_replicated_styles_keep_only_the_data_split_in_in_strategy():
    rules = dict(TENSOR_PARALLEL_RULES, **{"model.embed_tokens": "replicate",
                                           "lm_head": "replicate"})
    plan = Strategy(world_size=4, tensor=2, data=2, rules=rules).resolve(tiny())
    assert plan.in_strategy("model.embed_tokens.weight") == ((1, 1), (2,))
    assert plan.in_strategy("lm_head.weight") == ((2, 1), (1, 1))


def test_raw_in_strategy_resolves_to_the_same_plan_as_the_style(tmp_path):
    raw = {"model.embed_tokens": "[[4, 1], [1]]",
           "model.layers.*.self_attn.q_proj": "[[1, 1], [4, 1]]",
           "model.layers.*.self_attn.o_proj": "[[1, 4], [1, 4]]",
           "lm_head": "[[1, 1], [4, 1]]"}
    config = tiny(heads=8, kv_heads=4)
    styled = Strategy.default(tensor=4).resolve(config)
    plan = load_strategy(strategy_file(tmp_path, tensor=4, **raw)).resolve(config)
    for name in config.parameter_shapes():
        assert plan.style(name) == styled.style(name)
        if "norm" not in name:  # norms have no in_strategy
            assert plan.in_strategy(name) == styled.in_strategy(name)
        assert plan.slices(name, 3) == styled.slices(name, 3)


def test_raw_in_strategy_msinfer_cannot_run_lists_the_ones_it_can(tmp_path):
    path = strategy_file(tmp_path, tensor=4, **{"model.layers.*.mlp.up_proj": "[[1, 1], [2, 1]]"})
    with pytest.raises(MsinferError) as e:
        load_strategy(path).resolve(tiny())
    assert "rules.model.layers.*.mlp.up_proj: in_strategy [[1, 1], [2, 1]]" in str(e.value)
    assert "[[1, 1], [4, 1]] (colwise), [[1, 1], [1, 1]] (replicate)" in str(e.value)


def test_raw_in_strategy_on_a_norm_is_refused(tmp_path):
    path = strategy_file(tmp_path, tensor=2, **{"model.norm": "[[1, 1], [1, 1]]"})
    with pytest.raises(MsinferError, match="model.norm is a norm weight"):
        load_strategy(path).resolve(tiny())


def test_style_a_module_cannot_run_is_refused(tmp_path):
    path = strategy_file(tmp_path, tensor=2, **{"model.layers.*.self_attn.o_proj": "colwise"})
    with pytest.raises(MsinferError, match=r"rules\.model\.layers\.\*\.self_attn\.o_proj: "
                                           r"model\.layers\.0\.self_attn\.o_proj cannot be "
                                           r"colwise; msinfer runs it as rowwise or replicate"):
        load_strategy(path).resolve(tiny())


def test_attention_split_halfway_is_refused(tmp_path):
    path = strategy_file(tmp_path, tensor=2, **{"model.layers.*.self_attn.o_proj": "replicate"})
    with pytest.raises(MsinferError, match=r"self_attn has q_proj colwise, k_proj colwise, "
                                           r"v_proj colwise, o_proj replicate"):
        load_strategy(path).resolve(tiny())


def test_decoder_layers_must_share_one_sharding(tmp_path):
    rules = dict(TENSOR_PARALLEL_RULES)
    del rules["model.layers.*.mlp.gate_proj"]
    rules["model.layers.0.mlp.gate_proj"] = "colwise"
    rules["model.layers.1.mlp.gate_proj"] = "replicate"
    path = write(tmp_path, "world_size: 2\ntensor: 2\n" + rules_yaml(rules))
    with pytest.raises(MsinferError, match="shards every decoder layer alike, but "
                                           "model.layers.0.mlp.gate_proj is colwise and "
                                           "model.layers.1.mlp.gate_proj is replicate"):
        load_strategy(path).resolve(tiny())


def test_tied_lm_head_must_split_like_the_embedding(tmp_path):
    path = strategy_file(tmp_path, tensor=2, lm_head="replicate")
    with pytest.raises(MsinferError, match="ties lm_head to the embedding.*with "
                                           "model.embed_tokens vocab, lm_head must be "
                                           "colwise_gather, not replicate"):
        load_strategy(path).resolve(tiny(tie=True))


def test_tied_lm_head_without_a_rule_follows_the_embedding():
    rules = dict(TENSOR_PARALLEL_RULES)
    del rules["lm_head"]
    plan = Strategy(world_size=2, tensor=2, rules=rules).resolve(tiny(tie=True))
    assert plan.style("lm_head.weight") == "colwise_gather"
    assert plan.slices("lm_head.weight", 1) == plan.slices("model.embed_tokens.weight", 1)


def test_untied_model_needs_an_lm_head_rule():
    rules = dict(TENSOR_PARALLEL_RULES)
    del rules["lm_head"]
    with pytest.raises(MsinferError, match="no rule covers lm_head"):
        Strategy(world_size=2, tensor=2, rules=rules).resolve(tiny(tie=False))


def test_semi_auto_refuses_replicated_kv_heads_and_says_use_explicit(tmp_path):
    path = strategy_file(tmp_path, tensor=4, extra="parallel_mode: semi_auto\n")
    with pytest.raises(PlanRefused, match=r"parallel mode semi_auto: tensor=4 exceeds the 2 KV "
                                          r"heads.*only in the explicit mode"):
        load_strategy(path).resolve(PRESETS["qwen2-1.5b"])
    # The mode decided by the caller counts, not only the strategy file's.
    with pytest.raises(PlanRefused, match="parallel mode semi_auto"):
        Strategy.default(tensor=4).resolve(PRESETS["qwen2-1.5b"], "semi_auto")
    assert load_strategy(path).resolve(PRESETS["qwen2-1.5b"], "explicit").replicated_kv_heads


def test_parallel_mode_is_explicit_unless_the_caller_or_the_strategy_asks():
    assert decide_parallel_mode(None, Strategy.default()) == "explicit"
    assert decide_parallel_mode(None, Strategy.default(parallel_mode="semi_auto")) == "semi_auto"
    semi_auto = Strategy.default(parallel_mode="semi_auto")
    assert decide_parallel_mode("explicit", semi_auto) == "explicit"
    assert decide_parallel_mode("semi_auto", Strategy.default()) == "semi_auto"
    with pytest.raises(MsinferError, match="parallel mode 'auto': use explicit or semi_auto"):
        decide_parallel_mode("auto", Strategy.default())


def test_replicated_kv_heads_have_no_shard_in_strategy():
    plan = Strategy.default(tensor=4, parallel_mode="explicit").resolve(PRESETS["qwen2-1.5b"])
    with pytest.raises(MsinferError, match="no shard\\(\\) layout"):
        plan.in_strategy("model.layers.0.self_attn.k_proj.weight")
    assert plan.in_strategy("model.layers.0.self_attn.q_proj.weight") == ((1, 1), (4, 1))


def test_pipeline_is_refused_by_resolve_with_the_tensor_fix(tmp_path):
    path = write(tmp_path, "world_size: 4\ntensor: 2\npipeline: 2\n"
                 + rules_yaml(TENSOR_PARALLEL_RULES))
    with pytest.raises(PlanRefused, match=r"pipeline: 2: msinfer runs tensor and data "
                                          r"parallelism only; set tensor: 4 and pipeline: 1"):
        load_strategy(path).resolve(tiny())


def test_global_ranks_are_consecutive_within_a_tensor_group():
    plan = Strategy.default(tensor=2, data=2).resolve(tiny())
    assert [(plan.data_rank(r), plan.tensor_rank(r)) for r in range(4)] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(MsinferError, match="rank 4 is outside 0..3"):
        plan.tensor_rank(4)


def test_unknown_parameter_name_is_refused():
    plan = Strategy.default(tensor=2).resolve(tiny())
    with pytest.raises(MsinferError, match="'model.layers.9.mlp.up_proj.weight' is not a "
                                           "parameter of tiny"):
        plan.style("model.layers.9.mlp.up_proj.weight")


def test_tied_lm_head_reuses_the_embedding_split():
    tied = tiny(tie=True)
    vocab = Strategy.default(tensor=4).resolve(tied)
    assert vocab.style("lm_head.weight") == "colwise_gather"
    assert vocab.in_strategy("lm_head.weight") == ((1, 1), (4, 1))
    rules = dict(TENSOR_PARALLEL_RULES, **{"model.embed_tokens": "replicate",
                                           "lm_head": "replicate"})
    whole = Strategy(world_size=4, tensor=4, rules=rules).resolve(tied)
    assert whole.style("lm_head.weight") == "replicate"
    with pytest.raises(MsinferError, match="lm_head.bias"):
        Strategy.default(tensor=4).resolve(tiny(tie=False)).style("lm_head.bias")
