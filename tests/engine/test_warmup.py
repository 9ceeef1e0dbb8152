"""Warm-up compiles every graph serving runs: after `engine.warmup()`, a workload of several
short prompts completing in one prefill chunk (2, 3, 4 lm_head rows), mixed lengths (a prompt
over two chunks), and preemption (a KV pool smaller than the requests need together) compiles
no graph. In explicit mode a prefill call's rows are picked before the head graph, which is
then the decode step's of that batch; semi_auto pads a prefill call's rows to the most its
chunk can complete. Explicit mode's graphs are of dynamic shape (planning/shapes.py): as
many at max_len 32768 as at the default, and a prompt over several context buckets compiles
none."""
import pytest

from msinfer.engine.sampling import SamplingParams
from msinfer.planning.planner import make_plan
from msinfer.tools.tiny_model import make_tiny_model

pytest.importorskip("mindspore")

BLOCK = 4
# 2 layers x 2 KV heads x head_dim 16 x 4 tokens x K and V x 4 bytes
BYTES_PER_BLOCK = 2 * 2 * 16 * BLOCK * 2 * 4
ENGINE = dict(max_len=128, max_num_seqs=4, max_prefill_tokens=32, block_size=BLOCK,
              kv_cache_memory=33 * BYTES_PER_BLOCK)  # 32 usable blocks: 128 tokens
# Static graphs (semi_auto, and explicit mode's --graph-shapes static) are one per call
# shape: the workload's longest context is 46 tokens (a 40-token prompt and 6 more) in one
# context bucket, 64, so max_len 64 (5 shapes, not 10). Explicit mode's dynamic graphs (the
# default): the default max_len (4096) and a large one, chunks of up to 128 tokens (static
# rows at 16, 32 and 128, dynamic between: each kind of chunk graph), and a 150-token prompt
# over two chunks whose contexts span the buckets 128 and 256.
# The pool holds one sequence of max_len (the planner's floor): preemption only at 64.
STATIC = dict(ENGINE, graph_shapes="static")
DYNAMIC = dict(ENGINE, max_prefill_tokens=128)
WORKLOADS = {("semi_auto", 64): dict(ENGINE, max_len=64),
             ("static", 64): dict(STATIC, max_len=64),
             ("dynamic", 4096): dict(DYNAMIC, max_len=4096,
                                     kv_cache_memory=(4096 // BLOCK + 1) * BYTES_PER_BLOCK),
             ("dynamic", 32768): dict(DYNAMIC, max_len=32768,
                                      kv_cache_memory=(32768 // BLOCK + 1) * BYTES_PER_BLOCK)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("warm") / "model")
    make_tiny_model(path, layers=2, hidden=64, heads=4, kv_heads=2, vocab=512,
                    max_position=32768)
    return path


def prompt(length, first):
    return [(first + i) % 500 + 1 for i in range(length)]


# (prompts, max_tokens): several prompts completing in one chunk, then mixed lengths with a
# prompt over two chunks, then more than the pool holds at once (preemption).
WORKLOAD = [
    ([prompt(5, 1), prompt(11, 2), prompt(3, 3)], 4),            # 19 tokens, 3 rows: 4
    ([prompt(2, 4), prompt(3, 5)], 3),                            # 2 rows
    ([prompt(9, 6), prompt(1, 7), prompt(40, 8), prompt(6, 9)], 6),  # 40 spans two chunks
    ([prompt(10, 10 + i) for i in range(6)], 30),                 # 6 x 40 tokens > 128
]


LONG = ([prompt(150, 11)], 20)  # chunks of 128 and 22; contexts 128-169 (dynamic graphs)


@pytest.mark.parametrize("mode,max_len", list(WORKLOADS))
def test_after_warmup_a_mixed_workload_compiles_nothing(model_dir, mode, max_len):
    from msinfer import LLM

    llm = LLM(model_dir, parallel_mode="semi_auto" if mode == "semi_auto" else "explicit",
              **WORKLOADS[mode, max_len])
    runner = llm.engine.runner
    rows_seen = []
    prefill = runner.prefill

    def spy(chunks):
        rows_seen.append(sum(c.completes for c in chunks))
        return prefill(chunks)

    runner.prefill = spy
    compiled = llm.engine.warmup()
    assert compiled == llm.compilations > 0
    # what `msinfer plan` says warm-up compiles is what MindSpore compiled
    plan = make_plan(llm.config, llm.strategy, llm.profile, llm.limits,
                     parallel_mode=llm.parallel_mode)
    assert plan.warmup_graphs == compiled
    if mode == "dynamic":  # one graph per kind of call, whatever max_len (2 layers: 1 stack
        # per call kind and batch): embedding, decode at batches 1, 2, 4, prefill chunks of 16
        # and 32 rows, of dynamic rows and full, 2 heads
        # and the lm_head in each form a row count picks: the batches', and a chunk's
        # (more rows than the largest batch: prompt logprobs, a verification)
        graph_of = llm.engine.runner.graph_of
        assert graph_of.short_chunks == (16, 32)
        heads = {graph_of.head_weight_first(rows) for rows in (1, 2, 4, 16, 32, 64, 128)}
        assert compiled == 1 + 3 + 4 + len(heads)
    before = llm.compilations
    greedy = {}
    for prompts, max_tokens in WORKLOAD + ([LONG] if mode == "dynamic" else []):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for p, out in zip(prompts, llm.generate(prompts, params)):
            greedy[tuple(p)] = (max_tokens, out.token_ids)
    if mode == "dynamic":  # a row per prompt token: more rows than the largest batch
        llm.generate([prompt(20, 12)], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert llm.compilations == before, f"{llm.compilations - before} graphs compiled mid-work"
    assert {2, 3} <= set(rows_seen) and max(rows_seen) >= 3
    assert llm.engine.stats().num_preemptions > 0 or max_len > 64
    # the batched tokens are each prompt's own (rows picked right, padding harmless)
    for p in (WORKLOAD[0][0][1], WORKLOAD[2][0][2], WORKLOAD[3][0][5]):
        max_tokens, tokens = greedy[tuple(p)]
        alone = llm.generate([p], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True))[0]
        assert alone.token_ids == tokens
    assert llm.compilations == before


def call(shape):
    """A GraphShape's call: (kind, size, context, lm_head rows)."""
    return shape.kind, shape.size, shape.context, shape.rows


def test_shapes_say_how_many_rows_each_call_computes(model_dir):
    from msinfer import LLM

    runner = LLM(model_dir, **ENGINE).engine.runner
    assert runner.graph_of.dynamic  # the default
    shapes = runner.shapes()
    # explicit mode warms up one call per graph: every decode batch (static rows), a short
    # prefill chunk and a full one (static rows, dynamic context), each running the lm_head on
    # its rows; and the short chunk again with a row per token, for the head form of more
    # rows than the largest batch (prompt logprobs, verifications)
    assert [call(s) for s in shapes if s.kind == "decode"] == [("decode", b, 64, b)
                                                               for b in (1, 2, 4)]
    assert [call(s) for s in shapes if s.kind == "prefill"] == [("prefill", 16, 64, 1),
                                                                ("prefill", 32, 64, 1),
                                                                ("prefill", 16, 64, 16)]
    assert [(s.stack.rows, s.stack.context) for s in shapes if s.kind == "prefill"] == [
        (16, 0), (32, 0), (16, 0)]
    assert list(dict.fromkeys(s.stack for s in shapes)) == [
        g for g in runner.graph_of.all() if g.part == "layers"]
    assert {s.head for s in shapes} == {g for g in runner.graph_of.all() if g.part == "head"}
    assert {call(s)[:3] for s in shapes} == set(runner.graph_of.all().values())
    plan = runner.shape_plan
    # explicit: any prefill row count is a decode batch's head graph
    assert [plan.prefill_rows(n, 32) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert plan.prefill(20, 40, 3).head == plan.decode(3, 40).head == runner.graph_of.head(4)
    assert plan.prefill(20, 40, 0).head is None and plan.prefill(20, 40, 0).rows == 0
    # a short chunk (up to 32 tokens) takes its bucket's static rows, here the full chunk's
    # (32); a context pads to a multiple of 64 slots within its bucket
    assert [plan.padded_chunk(n) for n in (1, 5, 16, 17, 32)] == [16, 16, 16, 32, 32]
    assert [plan.padded_context(n) for n in (1, 64, 65, 128)] == [64, 64, 128, 128]
    # chunks of up to 128: static rows up to 32, dynamic rows (their own tokens) above, and
    # the full chunk's static rows within 16 of it
    wide = LLM(model_dir, **DYNAMIC).engine.runner
    assert [wide.shape_plan.padded_chunk(n) for n in (3, 20, 33, 60, 112, 113)] == [
        16, 32, 33, 60, 112, 128]
    assert [wide.graph_of.layers("prefill", n, 64).rows for n in (16, 32, 33, 112, 128)] == [
        16, 32, 0, 0, 128]
    semi_auto_runner = LLM(model_dir, parallel_mode="semi_auto", **ENGINE).engine.runner
    semi_auto = [call(s) for s in semi_auto_runner.shapes()]
    # semi_auto: every prefill call computes its chunk's most rows, with or without logits
    assert semi_auto_runner.shape_plan.prefill(20, 40, 0).rows == 4
    assert ("decode", 4, 128, 4) in semi_auto and ("prefill", 32, 64, 4) in semi_auto
    assert ("prefill", 32, 32, 4) not in semi_auto  # a context holds at least its chunk
    assert len(semi_auto) == 3 * 2 + 2 * 2  # batches 1, 2, 4 and chunks 16, 32 over 64, 128
    # explicit mode's static graphs: a call per shape too, which compiles its embedding (per
    # token count) and lm_head (per row count) on the way
    static = LLM(model_dir, **STATIC).engine.runner
    assert [static.shape_plan.padded_chunk(n) for n in (1, 5, 17)] == [16, 16, 32]  # its bucket
    assert [call(s)[:3] for s in static.shapes()] == [s[:3] for s in semi_auto]
    assert static.graph_count == len(semi_auto) + len({1, 2, 4, 16, 32}) + len({1, 2, 4})


def test_speculative_verifications_and_a_draft_compile_nothing_after_warmup(model_dir):
    """With speculative decoding the prefill chunks start at 2 tokens (a verification's last
    token and its proposals, and a draft's catch-up, run in static rows of their size, not
    padded to 16): warm-up compiles them, for the target and the draft model alike, and the
    plan counts them; verifying then compiles nothing."""
    from msinfer import LLM

    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    # the draft's KV cache has as many blocks as the target's
    llm = LLM(model_dir, **dict(DYNAMIC, kv_cache_memory=2 * 33 * BYTES_PER_BLOCK),
              speculative_config=spec)
    target, draft = llm.engine.runners
    assert target.graph_of.short_chunks == draft.graph_of.short_chunks == (2, 4, 8, 16, 32)
    assert [target.shape_plan.padded_chunk(n) for n in (1, 2, 3, 5, 9, 17)] == [
        2, 2, 4, 8, 16, 32]
    compiled = llm.engine.warmup()
    plan = make_plan(llm.config, llm.strategy, llm.profile, llm.limits,
                     speculative=llm.engine_config.speculative)
    assert plan.warmup_graphs == target.compilations
    assert compiled == target.compilations + draft.compilations
    sizes = []
    prefill = target.prefill

    def spy(chunks):
        sizes.append(target.shape_plan.prefill(sum(c.count for c in chunks), 64, 1).size)
        return prefill(chunks)

    target.prefill = spy
    before = llm.compilations
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm.generate([prompt(30, 1), prompt(7, 2)], params)
    llm.generate([prompt(9, 3)], params)
    assert llm.compilations == before, f"{llm.compilations - before} graphs compiled mid-work"
    assert llm.engine.stats().spec_num_accepted_tokens > 0  # its own draft: accepted
    # verifications in chunks of fewer than 16 rows (their tokens: test_speculative_models)
    assert {4, 8} & set(sizes)
