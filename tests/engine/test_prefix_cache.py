"""Prefix caching is exact: the same requests with the cache off and on give the same greedy
tokens and log-probabilities (1e-4), while the cache really serves their prefixes: a shared
system prompt, a prefix ending mid-block, a multi-turn chat, a prefix evicted between turns,
preempted sequences. One engine (the cache switched off, then on) on a small KV pool."""
import dataclasses

import numpy as np
import pytest

from msinfer import LLM, SamplingParams

BLOCK = 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    model_dir, config = tiny_checkpoint(layers=2, hidden=64, vocab=384, seed=1, heads=8,
                                        kv_heads=2, tie=False, config_style="4")
    per_block = 2 * 2 * BLOCK * 2 * 8 * 4  # K and V x layers x block x KV heads x dim x fp32
    # 40 usable blocks (160 tokens): four 54-token sequences outgrow it, so sequences preempt
    # and cached prefixes get evicted
    return LLM(model_dir, max_len=64, block_size=BLOCK, max_prefill_tokens=16, max_num_seqs=4,
               kv_cache_memory=41 * per_block)


def run(llm, caching):
    """The workload, in order; returns its outputs, call by call."""
    llm.engine.blocks.prefix_caching = caching
    rng = np.random.default_rng(7)

    def words(n):
        return rng.integers(5, 380, size=n).tolist()
    system = words(22)  # 5 full blocks and 2 tokens
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    calls = []

    def call(prompts, max_tokens=8):
        calls.append((prompts, llm.generate(prompts, dataclasses.replace(
            params, max_tokens=max_tokens))))
        return calls[-1][1]
    call([system + words(5), system + words(3)])  # computed together: the first turn
    call([system + words(4)])  # the system prompt's 5 blocks come from the cache
    call([system[:13] + words(6)])  # a prefix ending mid-block: 3 blocks
    call([words(17)])  # nothing shared
    first = system + words(6)
    answer = call([first])[0].token_ids
    call([first + answer + words(5)])  # the next turn resends the conversation
    call([words(30) for _ in range(6)], max_tokens=24)  # preempts, and evicts the system prompt's blocks
    call([system + words(2)])
    call([system + words(9 + i) for i in range(4)])  # shared by sequences running together
    return calls


@pytest.fixture(scope="module")
def runs(llm):
    without = run(llm, caching=False)
    stats_without = llm.engine.stats()
    with_cache = run(llm, caching=True)
    return without, with_cache, stats_without, llm.engine.stats()


def test_with_the_cache_every_token_and_logprob_is_what_it_is_without(runs):
    without, with_cache, _, _ = runs
    for n, ((prompts, ref), (same_prompts, got)) in enumerate(zip(without, with_cache)):
        assert prompts == same_prompts, f"call {n}"
        for i, (a, b) in enumerate(zip(ref, got)):
            assert a.token_ids == b.token_ids, f"call {n} prompt {i}"
            for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
                assert x.keys() == y.keys(), f"call {n} prompt {i} token {step}"
                for token in x:
                    assert abs(x[token] - y[token]) < TOLERANCE, (n, i, step, token)


def test_the_cache_served_the_prefixes_it_should(runs):
    without, with_cache, stats_without, stats = runs
    cached = [[out.cached_tokens for out in outs] for _, outs in with_cache]
    assert all(c == 0 for outs in without for c in [o.cached_tokens for o in outs[1]])
    assert cached[1] == [5 * BLOCK]  # the system prompt's full blocks
    assert cached[2] == [3 * BLOCK]  # 13 tokens: 3 full blocks
    assert cached[3] == [0]
    # the first turn's prompt and its answer but the last token (never fed back): computed
    computed_turn = len(with_cache[4][0][0]) + len(with_cache[4][1][0].token_ids) - 1
    assert cached[5] == [computed_turn // BLOCK * BLOCK]  # the conversation so far
    assert stats_without.num_preemptions > 0  # the churn preempted, with the cache too
    assert stats.num_preemptions > stats_without.num_preemptions
    assert stats_without.prefix_cache_queries == 0
    assert cached[7] == [0]  # evicted by the churn
    assert cached[8] == [5 * BLOCK] * 4  # computed again by call 7, shared by four at once
    hits = stats.prefix_cache_hits - stats_without.prefix_cache_hits
    assert hits == sum(map(sum, cached))
    computed = stats.prefill_tokens_computed - stats_without.prefill_tokens_computed
    computed_without = stats_without.prefill_tokens_computed
    assert computed < computed_without  # fewer prompt tokens went through prefill


def test_every_block_is_back_in_the_pool_and_the_pool_is_also_the_cache(llm, runs):
    blocks = llm.engine.blocks
    assert blocks.num_used == 0 and not any(blocks.refs)
    assert blocks.num_free == blocks.num_usable
    assert blocks.free_named  # what the last calls computed stays cached while free


def test_a_cache_salt_isolates_a_requests_prefix_cache(llm, runs):
    """vLLM's cache_salt: the salt enters the first block's name, so only requests with the
    same salt share cached blocks (with none, nothing salted); the tokens are the same."""
    llm.engine.blocks.prefix_caching = True
    prompt = np.random.default_rng(11).integers(5, 380, size=21).tolist()  # 5 full blocks

    def cached(salt):
        params = SamplingParams(max_tokens=2, temperature=0, cache_salt=salt)
        return llm.generate([prompt], params)[0]
    first = cached("tenant-a")
    assert first.cached_tokens == 0
    others = [cached("tenant-b"), cached(None)]
    assert [o.cached_tokens for o in others] == [0, 0]  # another salt, or none: not shared
    again = cached("tenant-a")
    assert again.cached_tokens == 5 * BLOCK  # the same salt: shared
    assert cached(None).cached_tokens == 5 * BLOCK  # the unsalted request's blocks are cached
    assert {tuple(o.token_ids) for o in [first, again] + others} == {tuple(first.token_ids)}
