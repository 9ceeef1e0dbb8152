"""Warm-up compiles every shape serving runs: after `engine.warmup()`, a workload of several
short prompts completing in one prefill chunk (2, 3, 4 lm_head rows), mixed lengths (a prompt
over two chunks), and preemption (a KV pool smaller than the requests need together) compiles
no graph. In explicit mode a prefill call's rows are picked before the head graph, which is
then the decode step's of that batch; semi_auto pads a prefill call's rows to the most its
chunk can complete."""
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
# The workload's longest context is 46 tokens (a 40-token prompt and 6 more): it runs one
# context bucket, 64, so warm-up compiles that one (5 shapes, not 10; 28 graphs -> 18).
WORKLOAD_ENGINE = dict(ENGINE, max_len=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("warm") / "model")
    make_tiny_model(path, layers=2, hidden=64, heads=4, kv_heads=2, vocab=512,
                    max_position=256)
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


@pytest.mark.parametrize("mode", ["explicit", "semi_auto"])
def test_after_warmup_a_mixed_workload_compiles_nothing(model_dir, mode):
    from msinfer import LLM

    llm = LLM(model_dir, parallel_mode=mode, **WORKLOAD_ENGINE)
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
    plan = make_plan(llm.config, llm.strategy, llm.profile, llm.limits, parallel_mode=mode)
    assert plan.warmup_graphs == compiled and plan.warmup_shapes == len(runner.shapes())
    before = llm.compilations
    greedy = {}
    for prompts, max_tokens in WORKLOAD:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for p, out in zip(prompts, llm.generate(prompts, params)):
            greedy[tuple(p)] = (max_tokens, out.token_ids)
    assert llm.compilations == before, f"{llm.compilations - before} graphs compiled mid-work"
    assert {2, 3} <= set(rows_seen) and max(rows_seen) >= 3
    assert llm.engine.stats().num_preemptions > 0
    # the batched tokens are each prompt's own (rows picked right, padding harmless)
    for p in (WORKLOAD[0][0][1], WORKLOAD[2][0][2], WORKLOAD[3][0][5]):
        max_tokens, tokens = greedy[tuple(p)]
        alone = llm.generate([p], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True))[0]
        assert alone.token_ids == tokens
    assert llm.compilations == before


def test_shapes_say_how_many_rows_each_call_computes(model_dir):
    from msinfer import LLM

    runner = LLM(model_dir, **ENGINE).engine.runner
    shapes = runner.shapes()
    assert ("decode", 4, 128, 4) in shapes and ("prefill", 32, 64, 1) in shapes
    assert ("prefill", 32, 32, 1) not in shapes  # a context holds at least its chunk
    assert len(shapes) == 3 * 2 + 2 * 2  # batches 1, 2, 4 and chunks 16, 32 over 64, 128
    # explicit: any prefill row count is a decode batch's head graph
    assert [runner.prefill_rows(n, 32) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert set(runner.row_buckets) == {s[1] for s in shapes if s[0] == "decode"}
