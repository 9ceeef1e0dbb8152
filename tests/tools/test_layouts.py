"""msinfer layouts: MindSpore's strategy rules, the IR reader, the reduced model, and the
command on every shipped strategy (clean, or refused as the planner refuses), with planted
violations reported."""
import functools
import glob
import json
import math
import os

import pytest

from msinfer.cli.main import main
from msinfer.config import PRESETS
from msinfer.tools.layouts import Call, check, parse_ir, small_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGIES = sorted(glob.glob(os.path.join(ROOT, "strategies", "*.yaml")))
TP4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")


def call(op, inputs, strategy, output=(), args=""):
    return Call("decode", op, "model.py:1 x", [tuple(s) for s in inputs], tuple(output),
                strategy, args)


def rules(c, devices=4):
    return [v.rule for v in check(c, devices)]


# ---- the rules, one by one ----

def test_a_legal_colwise_matmul_has_no_violation():
    assert rules(call("MatMul", [(16, 64), (128, 64)], ((1, 1), (4, 1)),
                      args="%1, %2, Bool(0), Bool(1)")) == []


def test_strategy_length_must_equal_the_input_rank():
    found = rules(call("Gather", [(12, 64), (16,)], ((4, 1), (1, 1)), args="%1, %2, I64(0)"))
    assert found == ["strategy (1, 1) has 2 entries for a rank-1 input (16,)"]


def test_one_strategy_per_tensor_input():
    found = rules(call("Add", [(16, 64), (16, 64)], ((1, 1),)))
    assert found == ["in_strategy ((1, 1),) has 1 entries for 2 tensor inputs"]


def test_a_split_must_divide_its_axis_be_a_power_of_two_and_fit_the_devices():
    assert rules(call("Neg", [(1, 28, 4)], ((1, 4, 1),))) == []
    assert rules(call("Neg", [(6, 28, 4)], ((4, 1, 1),))) == [
        "split 4 does not divide axis 0 of size 6 (shape (6, 28, 4))"]
    assert rules(call("Neg", [(6, 28)], ((3, 1),)), devices=4) == [
        "split 3 of axis 0 is not a power of two (4 devices)",
        "strategy (3, 1) asks for 3 devices, which do not divide the 4"]
    assert rules(call("Neg", [(6, 28)], ((3, 1),)), devices=6) == []
    assert rules(call("Neg", [(8, 28)], ((8, 1),)), devices=4) == [
        "strategy (8, 1) asks for 8 devices, which do not divide the 4"]


def test_matmul_contracted_axes_split_alike_with_transpose_b():
    found = rules(call("MatMul", [(16, 64), (128, 64)], ((1, 4), (4, 1)),
                       args="%1, %2, Bool(0), Bool(1)"))
    assert found == ["the contracted axis is split 4 in input 0 but 1 in input 1 "
                     "(transpose_b=True)"]
    assert rules(call("MatMul", [(16, 64), (64, 128)], ((1, 4), (4, 1)),
                      args="%1, %2, Bool(0), Bool(0)")) == []


def test_batch_matmul_batch_axes_split_alike():
    found = rules(call("BatchMatMul", [(1, 4, 8, 4), (1, 4, 64, 4)], ((1, 4, 1, 1), (1, 1, 1, 1)),
                       args="%1, %2, Bool(0), Bool(1)"))
    assert found == ["batch axis 1 is split 4 and 1: batch axes split alike"]


def test_gather_table_split_on_the_gathered_axis_takes_unsplit_ids_unless_both_2d():
    gather = "%1, %2, I64(0), I64(0)"
    assert rules(call("Gather", [(12, 64), (16,)], ((4, 1), (1,)), args=gather)) == []
    assert rules(call("Gather", [(12, 64), (16,)], ((1, 1), (4,)), args=gather)) == []
    found = rules(call("Gather", [(12, 64), (16,)], ((2, 1), (2,)), args=gather))
    assert found[0].startswith("the table is split on the gathered axis 0, so the indices "
                               "cannot be split")
    # MindSpore's "batch and axis" mode: both 2-D, splits multiplying to the devices.
    assert rules(call("Gather", [(12, 64), (16, 1)], ((2, 1), (2, 1)), args=gather)) == []
    assert rules(call("Gather", [(12, 64), (16,)], ((2, 2), (1,)), args=gather)) == []
    assert rules(call("Gather", [(12, 64), (16,)], ((2, 2), (1,)), args=gather), 8) == [
        "split on axis 0 and axis 1 cannot be repeated over devices"]


def test_scatter_update_axis_0_and_indices_unsplit_updates_as_indices_plus_input():
    assert rules(call("ScatterUpdate", [(256, 4, 8), (16,), (16, 4, 8)],
                      ((1, 4, 1), (1,), (1, 4, 1)))) == []
    found = rules(call("ScatterUpdate", [(256, 4, 8), (16,), (16, 4, 8)],
                       ((4, 1, 1), (1,), (1, 1, 1))))
    assert found == ["axis 0 (the rows ScatterUpdate writes) cannot be split"]
    found = rules(call("ScatterUpdate", [(256, 4, 8), (16,), (16, 4, 8)],
                       ((1, 4, 1), (1,), (4, 1, 1))))
    assert found == ["updates must be split as indices + input[1:] = (1, 4, 1), got (4, 1, 1)"]


def test_elementwise_splits_equal_where_neither_input_broadcasts():
    assert rules(call("Add", [(1, 4, 7, 16, 64), (1, 1, 1, 16, 64)],
                      ((1, 4, 1, 1, 1), (1, 1, 1, 1, 1)))) == []
    assert rules(call("Mul", [(64,), (16, 64)], ((1,), (2, 1)))) == []
    found = rules(call("Mul", [(16, 28, 4), (16, 28, 4)], ((1, 4, 1), (1, 2, 1))))
    assert found == ["axis 1 (sizes 28 and 28) is split 4 and 2: where neither input "
                     "broadcasts, the splits must be equal"]


def test_softmax_axis_sliced_axes_and_concat_axis_stay_whole():
    assert rules(call("Softmax", [(1, 4, 8, 64)], ((1, 1, 1, 4),), args="%1, (I64(-1))")) == [
        "the softmax axis 3 cannot be split"]
    assert rules(call("StridedSlice", [(16, 4, 36)], ((1, 4, 1),), output=(16, 4, 28))) == []
    assert rules(call("StridedSlice", [(16, 144)], ((1, 4),), output=(16, 112))) == [
        "axis 1 is sliced (144 -> 112) and cannot be split"]
    assert rules(call("Concat", [(16, 28, 2), (16, 28, 2)], ((1, 1, 2), (1, 1, 2)),
                      args="%1, I64(-1)")) == ["the concat axis 2 cannot be split"] * 2


def test_a_primitive_without_in_strategy_is_named_but_reshape_and_plumbing_are_not():
    found = rules(call("Tile", [(1, 16, 64)], None))
    assert found == ["no in_strategy: step_parallel would give it the batch-parallel default "
                     "(axis 0 split over all devices)"]
    assert rules(call("Reshape", [(16, 144)], None)) == []
    assert rules(call("Load", [(16, 144)], None)) == []


# ---- reading MindSpore's IR ----

IR = """\
  %2(CNode_1020$x) = PrimFunc_Gather(%1, %para1_ids, I64(0), I64(0)) {instance name: gather} primitive_attrs: {in_strategy: ((4, 1), (1))}
      : (<Tensor[Float32], (256, 224)>, <Tensor[Int32], (2)>, <Int64, NoShape>, <Int64, NoShape>) -> (<Tensor[Float32], (2, 224)>)
      # In file /x/msinfer/model.py:200~206, 4~73/    def construct(self, ids):/
      # In file /x/msinfer/parallel_layers.py:159, 19~46/            return self.gather(weight, ids, 0)/<~~This line of code can be shared by multiple nodes, and may be duplicated./
  %6(CNode_1024) = PrimFunc_Add(%5, Tensor(shape=[], dtype=Float32, value=1e-06)) primitive_attrs: {in_strategy: ((2, 1), ())}
      : (<Tensor[Float32], (2, 1)>, <Tensor[Float32], (), value=...>) -> (<Tensor[Float32], (2, 1)>)
  %21(CNode_1036) = PrimFunc_Concat(%20, I64(-1)) primitive_attrs: {in_strategy: ((1, 4, 1), (1, 4, 1))}
      : (<Tuple[Tensor[Float32]*2], TupleShape((2, 28, 4), (2, 28, 4)), elements_use_flags={[const vector]{1, 1}}>, <Int64, NoShape>) -> (<Tensor[Float32], (2, 28, 8)>)
  %40(k_written) = ScatterUpdate(%para16_k_cache, %para4_write_slots, %37, %39) {instance name: write_rows} primitive_attrs: {output_names: [y], side_effect_mem: Bool(1), input_names: [x, indices, updates], use_locking: Bool(1)}
      : (<Ref[Tensor[Float32]], (64, 4, 8), ref_key=k_cache, is_parameter, is_inplace>, <Tensor[Int32], (2)>, <Tensor[Float32], (2, 4, 8)>, <UMonad, NoShape>) -> (<Tensor[Float32], (64, 4, 8)>)
  %0(CNode_1018) = Load(%para18_model.norm.weight, UMonad[U])
      : (<Ref[Tensor[Float32]], (224), ref_key=model.norm.weight, is_parameter>, <UMonad, NoShape>) -> (<Tensor[Float32], (224)>)
"""


def test_parse_ir_reads_ops_shapes_strategies_and_the_msinfer_source_line():
    gather, add, concat, scatter, load = parse_ir(IR, "decode")
    assert (gather.op, gather.inputs, gather.strategy, gather.output) == (
        "Gather", [(256, 224), (2,)], ((4, 1), (1,)), (2, 224))
    assert gather.source == "parallel_layers.py:159 return self.gather(weight, ids, 0)"
    assert gather.per_rank() == [(64, 224), (2,)]
    assert (add.inputs, add.strategy) == ([(2, 1), ()], ((2, 1), ()))
    assert (concat.inputs, concat.strategy) == ([(2, 28, 4), (2, 28, 4)],
                                                ((1, 4, 1), (1, 4, 1)))
    assert (scatter.op, scatter.inputs, scatter.strategy) == (
        "ScatterUpdate", [(64, 4, 8), (2,), (2, 4, 8)], None)
    assert check(scatter, 4)[0].rule.startswith("no in_strategy")
    assert (load.op, load.inputs, check(load, 4)) == ("Load", [(224,)], [])


def test_what_the_graph_returns_must_be_whole_on_every_rank():
    ir = """\
  %7(y) = PrimFunc_MatMul(%5, %6, Bool(0), Bool(1)) {instance name: matmul} primitive_attrs: {in_strategy: ((1, 1), (4, 1))}
      : (<Tensor[Float32], (2, 64)>, <Tensor[Float32], (24, 64)>, <Bool, NoShape>, <Bool, NoShape>) -> (<Tensor[Float32], (2, 24)>)
  %8(CNode_1) = Depend(%7, %3)
      : (<Tensor[Float32], (2, 24)>, <UMonad, NoShape>) -> (<Tensor[Float32], (2, 24)>)
  Return(%8)
"""
    matmul, depend = parse_ir(ir, "decode")
    assert matmul.returned and not depend.returned
    assert rules(matmul) == ["its output leaves the graph, split ((1, 1), (4, 1)): each rank "
                             "would return only its slice"]


# ---- the reduced model ----

@pytest.mark.parametrize("preset", ["qwen2-0.5b", "qwen2-1.5b", "qwen2-7b", "qwen2-72b"])
def test_the_reduced_model_divides_by_the_same_splits_as_the_real_one(preset):
    real = PRESETS[preset]
    for world in (1, 2, 4, 8):
        small = small_config(real, world)
        assert (small.num_heads, small.num_kv_heads) == (real.num_heads, real.num_kv_heads)
        assert small.hidden_size == small.num_heads * small.head_dim
        assert small.tie_word_embeddings == real.tie_word_embeddings
        for split in range(1, world + 1):
            for a, b in ((real.vocab_size, small.vocab_size),
                         (real.intermediate_size, small.intermediate_size),
                         (real.num_heads * real.head_dim, small.num_heads * small.head_dim)):
                assert (a % split == 0) == (b % split == 0), (preset, world, split, a, b)
        assert small.vocab_size <= math.lcm(*range(1, 9))


# ---- the command: every shipped strategy on Qwen2-1.5B/7B/72B shapes ----

# What semi_auto cannot run, refused as the planner refuses it; everything else is clean.
REFUSED = {("qwen2-1.5b", "qwen2_tp4"): "tensor=4 exceeds the 2 KV heads",
           ("qwen2-1.5b", "qwen2_tp8"): "the 12 attention heads do not split into 8",
           ("qwen2-7b", "qwen2_tp8"): "the 28 attention heads do not split into 8"}


def report(model, strategy, hardware="cpu"):
    """msinfer.tools.layouts.run, once per module for each (model, strategy, hardware): each
    compiles a decode step and a prefill chunk. The tests read the report, never change it."""
    return _report(model, strategy, hardware)


@functools.lru_cache(maxsize=None)
def _report(model, strategy, hardware):
    from msinfer.tools import layouts

    return layouts.run(model, strategy, hardware)


@pytest.mark.parametrize("model", ["qwen2-1.5b", "qwen2-7b", "qwen2-72b"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=os.path.basename)
def test_every_shipped_strategy_is_clean_or_refused_like_the_planner(model, strategy, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr("msinfer.cli.layouts.run", report)  # the command prints the report
    code = main(["layouts", "--model", model, "--strategy", strategy])
    out = capsys.readouterr().out
    refusal = REFUSED.get((model, os.path.basename(strategy)[:-5]))
    if refusal:
        assert code == 1 and "REFUSED" in out and refusal in out
        return
    assert code == 0, out
    assert "clean:" in out and "violation" not in out
    for op in ("Gather", "MatMul", "BatchMatMul", "ScatterUpdate", "Softmax", "StridedSlice"):
        assert f"decode   {op} (" in out and f"prefill  {op} (" in out, op


def test_json_shows_the_cache_split_by_kv_head_and_the_embedding_ids_1d(capsys):
    assert main(["layouts", "--model", "qwen2-72b", "--strategy", TP4, "--json",
                 "--hardware", "atlas-300i-duo"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "float16" and report["violations"] == []
    kv = report["built"]["num_kv_heads"]
    writes = [c for c in report["calls"] if c["op"] == "ScatterUpdate"]
    assert writes and all(c["in_strategy"][0] == [1, 4, 1] for c in writes)
    assert all(c["per_rank"][0][1] == kv // 4 for c in writes)
    embedding = [c for c in report["calls"] if c["source"].startswith("layers/embedding.py")
                 and c["op"] == "Gather"]
    assert {tuple(map(tuple, c["in_strategy"])) for c in embedding} == {((4, 1), (1,))}
    assert any(c["op"] == "Cast" for c in report["calls"])  # float16: softmax casts checked


def test_the_logits_leave_the_real_graph_whole():
    returned = [(c.graph, c.op, c.strategy) for c in report("qwen2-7b", TP4)["calls"]
                if c.returned]
    assert returned == [("decode", "Identity", ((1, 1),)), ("prefill", "Identity", ((1, 1),))]


# ---- the quantized matmuls (MindSpore's QuantV2Info, QuantBatchMatmulInfo and
# WeightQuantBatchMatmulInfo) ----

QBMM_ARGS = "%1, %2, %3, None, %4, None, Bool(0), Bool(1), I64(42)"  # x, w, scale, -, bias
WQBMM_ARGS = "%1, %2, %3, %4, None, None, None, Bool(0), Bool(1), I64(0)"


def test_quant_batch_matmul_column_parallel_is_legal_its_scales_go_by_output_columns():
    column = [(16, 64), (128, 64), (128,), (128,)]
    assert rules(call("QuantBatchMatmul", column, ((1, 1), (4, 1), (4,), (4,)),
                      args=QBMM_ARGS)) == []
    assert rules(call("QuantBatchMatmul", column, ((1, 1), (4, 1), (1,), (4,)),
                      args=QBMM_ARGS)) == [
        "QuantBatchMatmul lays this input out as the output's columns, (4,), not (1,)"]


def test_quant_batch_matmul_split_contracted_axis_takes_no_bias():
    """MindSpore sums a split reduction with an AllReduce after the op: a bias in it would be
    added once per rank."""
    row = [(16, 64), (128, 64), (128,), (128,)]
    found = check(call("QuantBatchMatmul", row, ((1, 4), (1, 4), (1,), (1,)), args=QBMM_ARGS),
                  4)
    assert [(v.input, v.rule) for v in found] == [
        (3, "the contracted axis is split 4: MindSpore sums the 4 partial products with an "
            "AllReduce after the op, so a bias given to the op is added 4 times")]
    assert rules(call("QuantBatchMatmul", row[:3], ((1, 4), (1, 4), (1,)),
                      args="%1, %2, %3, None, None, None, Bool(0), Bool(1), I64(42)")) == []
    assert rules(call("QuantBatchMatmul", row[:3], ((1, 4), (1, 2), (1,)),
                      args="%1, %2, %3, None, None, None, Bool(0), Bool(1), I64(42)")) == [
        "the contracted axis is split 4 in input 0 but 2 in input 1 (transpose_b=True)"]


def test_weight_quant_batch_matmul_scales_by_columns_group_wise_ones_as_the_weight():
    assert rules(call("WeightQuantBatchMatmul", [(16, 64), (128, 64), (128,), (128,)],
                      ((1, 1), (4, 1), (4,), (4,)), args=WQBMM_ARGS)) == []
    group_wise = [(16, 64), (128, 64), (128, 4), (128, 4)]
    assert rules(call("WeightQuantBatchMatmul", group_wise,
                      ((1, 4), (1, 4), (1, 4), (1, 4)), args=WQBMM_ARGS)) == []
    assert rules(call("WeightQuantBatchMatmul", group_wise,
                      ((1, 4), (1, 4), (1, 1), (1, 4)), args=WQBMM_ARGS)) == [
        "WeightQuantBatchMatmul lays this input out as the output's columns, (1, 4), not "
        "(1, 1)"]


def test_quant_v2_scale_and_offset_broadcast_against_x():
    quant = "%1, %2, %3, Bool(0), I64(0), I64(32)"
    assert rules(call("QuantV2", [(16, 64), (1,), (1,)], ((2, 2), (1,), (1,)), args=quant)) == []
    assert rules(call("QuantV2", [(16, 64), (64,), (1,)], ((1, 4), (1,), (1,)), args=quant)) == [
        "axis 1 (sizes 64 and 64) is split 4 and 1: where neither input broadcasts, the "
        "splits must be equal"]


def test_semi_auto_lays_out_only_the_schemes_with_ascend_kernels():
    from msinfer.errors import MsinferError
    from msinfer.layers.linear_methods import AscendW8A8Method, semi_auto_method

    assert semi_auto_method("W8A8S") is AscendW8A8Method
    with pytest.raises(MsinferError, match="W8A8_DYNAMIC has no Ascend kernel"):
        semi_auto_method("W8A8_DYNAMIC")


def test_only_the_quantized_primitives_missing_cpu_kernels_after_the_dump_is_tolerated(
        tmp_path):
    from msinfer.tools.layouts import STAGE, ascend_only

    def failure(op):
        return RuntimeError(f"- Kernel select failed:\nUnsupported op [{op}] on CPU, Please "
                            f"confirm whether the device target setting is correct")

    assert not ascend_only(failure("QuantV2"), tmp_path)  # nothing written yet
    (tmp_path / f"{STAGE}0160.ir").write_text("")
    assert ascend_only(failure("QuantV2"), tmp_path)
    assert ascend_only(failure("WeightQuantBatchMatmul"), tmp_path)
    assert not ascend_only(failure("MatMul"), tmp_path)
    assert not ascend_only(RuntimeError("Invalid backend: CPU"), tmp_path)


QUANTIZED = {"qwen2.5-72b-w8a8": TP4,  # W8A8: one run each
             "qwen2.5-7b-w8a16": os.path.join(ROOT, "strategies", "qwen2_dp2_tp2.yaml")}


@pytest.mark.parametrize("model", sorted(QUANTIZED))
def test_a_quantized_model_is_laid_out_on_its_ascend_primitives_and_clean(model, capsys,
                                                                          monkeypatch):
    """Built with the Ascend methods on CPU: the compile stops at kernel selection (no CPU
    kernel for QuantV2 and the quantized matmuls), after the graph the check reads."""
    monkeypatch.setattr("msinfer.cli.layouts.run", report)
    assert main(["layouts", "--model", model, "--strategy", QUANTIZED[model]]) == 0
    assert "clean:" in capsys.readouterr().out
    found = report(model, QUANTIZED[model])
    assert found["built"]["dtype"] == "float16" and found["violations"] == []
    t, d = found["tensor"], found["data"]
    matmuls = [c for c in found["calls"] if c.op.endswith("QuantBatchMatmul")]
    assert {c.graph for c in matmuls} == {"decode", "prefill"}
    assert not any(c.op == "MatMul" and c.source.startswith(("layers/mlp", "layers/self_att"))
                   for c in found["calls"])  # every projection quantized
    column = [c for c in matmuls if c.strategy[1] == (t, 1)]
    row = [c for c in matmuls if c.strategy[1] == (1, t)]
    assert column and row and len(column) + len(row) == len(matmuls)
    assert all(c.strategy[0] == (d, 1) and set(c.strategy[2:]) == {(t,)} for c in column)
    assert all(c.strategy[0] == (d, t) and set(c.strategy[2:]) == {(1,)} for c in row)
    if model.endswith("w8a8"):  # QuantV2 splits x as its matmul; row-parallel: no bias
        quants = [c for c in found["calls"] if c.op == "QuantV2"]
        assert len(quants) == len(matmuls)
        assert {c.strategy[1:] for c in quants} == {((1,), (1,))}
        assert all(len(c.inputs) == 3 for c in row) and all(len(c.inputs) == 4 for c in column)
        after = [c for c in found["calls"] if c.op == "Add"
                 and c.source.startswith("layers/linear_methods.py")]
        assert len(after) == len(row) and {c.strategy for c in after} == {((d, 1), (1,))}


# ---- planted violations ----

def planted(tmp_path, **rules):
    text = open(TP4).read()
    for module, rule in rules.items():
        start = text.index(f"  {module}: ")
        end = text.index("\n", start)
        text = text[:start] + f"  {module}: {rule}" + text[end:]
    path = tmp_path / "planted.yaml"
    path.write_text(text)
    return str(path)


def test_a_raw_in_strategy_of_the_wrong_rank_is_reported(tmp_path, capsys):
    """The embedding's old strategy: 2-D for the 1-D ids."""
    path = planted(tmp_path, **{"model.embed_tokens": "[[4, 1], [1, 1]]"})
    assert main(["layouts", "--model", "qwen2-7b", "--strategy", path]) == 1
    out = capsys.readouterr().out
    assert "2 violation(s)" in out
    import msinfer.layers.embedding as source
    line = [text.strip() for text in open(source.__file__).read().splitlines()].index(
        "return self.gather(weight, ids, 0)") + 1
    assert (f"Gather at layers/embedding.py:{line} return self.gather(weight, ids, 0) (decode), "
            "input 1: strategy (1, 1) has 2 entries for a rank-1 input (1,)") in out
    assert "(prefill), input 1: strategy (1, 1) has 2 entries for a rank-1 input (16,)" in out
    assert "msinfer itself refuses this strategy" in out


def test_a_split_that_does_not_divide_is_reported(tmp_path, capsys):
    """Ids split 4 ways: a prefill chunk of 16 divides, a decode step of one token does not."""
    path = planted(tmp_path, **{"model.embed_tokens": "[[1, 1], [4]]", "lm_head": "replicate"})
    assert main(["layouts", "--model", "qwen2-7b", "--strategy", path, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(v["op"], v["graph"], v["input"], v["rule"]) for v in report["violations"]] == [
        ("Gather", "decode", 1, "split 4 does not divide axis 0 of size 1 (shape (1,))")]


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(["layouts", "--model", "qwen2-7b", "--strategy",
                 str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: cannot read strategy file" in capsys.readouterr().err
    assert main(["layouts", "--model", "qwen3-9b", "--strategy", TP4]) == 2
    assert "not a built-in model" in capsys.readouterr().err


# ---- where the parallel context is set ----

def test_semi_auto_cell_sets_the_context_only_for_the_model_and_only_with_several_ranks(
        monkeypatch):
    """AutoParallel(model, "semi_auto") with full_batch: MindSpore applies it when that cell
    compiles and clears it after, so the job seed's AllReduce never compiles under it."""
    import mindspore as ms
    from mindspore import nn
    from mindspore.parallel import _utils, auto_parallel

    from msinfer.engine.model_runner import semi_auto_cell

    model = nn.Cell()
    assert semi_auto_cell(model, 1) is model
    monkeypatch.setattr(auto_parallel, "get_rank", lambda: 1)
    monkeypatch.setattr(auto_parallel, "get_group_size", lambda: 4)
    cell = semi_auto_cell(model, 4)
    assert cell.network is model
    assert ms.get_auto_parallel_context("parallel_mode") == "stand_alone"
    _utils._init_auto_parallel_context(cell)  # what Cell.compile does first
    try:
        assert ms.get_auto_parallel_context("parallel_mode") == "semi_auto_parallel"
        assert ms.get_auto_parallel_context("full_batch") is True
        assert ms.get_auto_parallel_context("device_num") == 4
    finally:
        _utils._clear_auto_parallel_context(cell)  # and last
    assert ms.get_auto_parallel_context("parallel_mode") == "stand_alone"
