"""The forms explicit mode takes on MindSpore's CPU backend: the matmul forms of each
processor (hardware.cpu_matmul_forms), and those that keep a compiled graph small for its
lifetime (layers/cpu_forms.Expand, CacheLayout.rows_by_head: CPU kernels of a broadcasting
Add/Mul and of a Transpose keep an int64 index per output element for as long as their graph
lives).

Every product order is Qwen2: each processor's table, forced with thresholds these tiny
calls cross (prefill chunks of 16 rows, decode steps of 1-2), matches transformers.

Read from the graphs MindSpore compiles (its IR dump, parsed by msinfer.tools.layouts), with every
operand expanded whatever its size (Expand.MIN_ELEMENTS = 1): no elementwise op broadcasts a
tensor operand, a decode step has no Transpose, a prefill chunk transposes its queries and
its output only, never the gathered context. And the model is still Qwen2: log-probabilities
within 1e-4 of transformers in that form.
"""
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_parity import (ENGINE, assert_matches_hf, case_spec, greedy,  # noqa: E402
                         prompts_for)

from msinfer import LLM  # noqa: E402
from msinfer.tools.layouts import ELEMENTWISE, dumping_ir, parse_ir, stage_dumps  # noqa: E402

CONTEXT = 128  # a context bucket no other axis of these graphs has
# Two sequences at a time: decode steps of 1 and 2 rows and prefill chunks of 16 cross every
# threshold of the tables below (a batch of 4 would be 3 more graphs on the same side of each).
FORMS_ENGINE = dict(ENGINE, max_num_seqs=2)
GQA = case_spec("gqa_untied_config4")  # 8 query heads over 2 KV heads, as test_parity's


@pytest.fixture(scope="module")
def expanded(tmp_path_factory, tiny_checkpoint, hf_model):
    """An engine whose every elementwise operand is expanded, its compiled calls by kind, and
    transformers on the same checkpoint."""
    from msinfer import hardware
    from msinfer.layers.cpu_forms import Expand

    patch = pytest.MonkeyPatch()
    patch.setattr(Expand, "MIN_ELEMENTS", 1)
    # Products as x @ W at these sizes, so that the only Transposes are attention's.
    patch.setattr("msinfer.layers.cpu_forms.cpu_matmul_forms",
                  lambda: hardware.CpuMatmulForms(in_out=True))
    model_dir, config = tiny_checkpoint(**GQA)
    llm = LLM(model_dir, **ENGINE)
    calls = {kind: compiled_calls(llm, kind, size, tmp_path_factory.mktemp(kind))
             for kind, size in (("decode", 2), ("prefill", 16))}
    yield config, llm, calls, hf_model(model_dir)
    patch.undo()


def compiled_calls(llm, kind, size, folder):
    """The primitive calls of the graphs (embedding, layers, lm_head) one call compiles."""
    with dumping_ir(folder):
        llm.engine.runner.compile_shape(llm.engine.runner.shape_plan.at(kind, size, CONTEXT))
    calls = []
    for name in stage_dumps(folder):
        with open(os.path.join(folder, name)) as f:
            calls += parse_ir(f.read(), kind)
    return calls


@pytest.mark.parametrize("forms", ["AuthenticAMD", "GenuineIntel", "every row weight-first"])
def test_each_processors_matmul_forms_are_qwen2(tiny_checkpoint, hf_model, monkeypatch, forms):
    from msinfer import hardware

    table = {"AuthenticAMD": hardware.CpuMatmulForms(in_out=True, head_weight_first=(2, None)),
             "GenuineIntel": hardware.CpuMatmulForms(in_out=False, mlp_weight_first=(2, 8),
                                                     head_weight_first=(2, None)),
             "every row weight-first": hardware.CpuMatmulForms(
                 in_out=False, mlp_weight_first=(1, None), head_weight_first=(1, None))}
    monkeypatch.setattr("msinfer.layers.cpu_forms.cpu_matmul_forms", lambda: table[forms])
    model_dir, config = tiny_checkpoint(**GQA)
    llm = LLM(model_dir, **FORMS_ENGINE)
    hf = hf_model(model_dir)
    prompts = prompts_for(config.vocab_size, seed=11, lengths=(37, 5, 11))
    for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, greedy(384, 6)))):
        assert_matches_hf(hf, prompt, out, config.vocab_size, f"{forms}: prompt {i}")


def test_no_elementwise_op_broadcasts_a_tensor_operand(expanded):
    config, llm, calls, hf = expanded
    for kind, found in calls.items():
        elementwise = [c for c in found if c.op in ELEMENTWISE]
        assert len(elementwise) > 10, f"{kind}: the IR reader found no elementwise ops"
        broadcasting = [(c.op, c.inputs, c.source) for c in elementwise
                        if len(c.inputs) == 2 and all(c.inputs)
                        and c.inputs[0] != c.inputs[1]]
        assert broadcasting == [], kind


def test_the_gathered_context_is_never_transposed(expanded):
    """A prefill graph's axes are dynamic (-1): its Transposes are told from the context's by
    rank: queries and output are (groups, queries, kv, groups, d) and back, 5-D; the gathered
    context is (groups, kv, context, d)."""
    config, llm, calls, hf = expanded
    decode = [c for c in calls["decode"] if c.op == "Transpose"]
    assert decode == []
    prefill = [c for c in calls["prefill"] if c.op == "Transpose"]
    layers = llm.engine.runner.layers_per_call(16, 1, CONTEXT)
    assert len(prefill) == 2 * layers  # each layer's queries and its output, by head and back
    assert all(len(c.inputs[0]) == 5 for c in prefill), prefill
    cache_rows = llm.engine.runner.caches[0][0].shape
    gathers = [c for c in calls["prefill"] if c.op == "Gather"
               and c.inputs[0] == tuple(cache_rows)]
    assert len(gathers) == 2 * layers  # K and V, each read by rows of head_dim


def test_with_every_operand_expanded_it_is_still_qwen2(expanded):
    config, llm, calls, hf = expanded
    prompts = prompts_for(config.vocab_size, seed=9, lengths=(37, 5))
    for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, greedy(384, 8)))):
        assert_matches_hf(hf, prompt, out, config.vocab_size, f"prompt {i}")


def test_the_processors_vendor_picks_its_measured_forms(tmp_path):
    from msinfer.hardware import CPU_MATMUL_FORMS, cpu_matmul_forms

    def forms(vendor):
        path = tmp_path / vendor
        path.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: x\n")
        return cpu_matmul_forms(str(path))

    assert forms("GenuineIntel") == CPU_MATMUL_FORMS["GenuineIntel"]
    assert not forms("GenuineIntel").in_out
    assert forms("AuthenticAMD").in_out
    assert forms("SomeOtherVendor") == CPU_MATMUL_FORMS["AuthenticAMD"]
    assert cpu_matmul_forms(str(tmp_path / "missing")) == CPU_MATMUL_FORMS["AuthenticAMD"]


def test_blocked_transpose_is_the_transpose_across_block_edges():
    """The host's blocked copy of the lm_head's (vocab, rows) logits: blocks that divide the
    vocabulary, that do not, and one larger than it."""
    import numpy as np

    from msinfer.engine.model_runner import blocked_transpose

    columns = np.random.default_rng(0).standard_normal((1000, 7)).astype(np.float32)
    for block in (1, 100, 333, 4096):
        rows = blocked_transpose(columns, block)
        assert rows.flags.c_contiguous and rows.dtype == columns.dtype
        np.testing.assert_array_equal(rows, columns.T)
