"""Speculative decoding on a real checkpoint, against transformers: with each method (n-gram,
suffix, a draft model), greedy tokens are transformers' greedy choice at every position and
the reported logprobs are its log_softmax (within test_parity's tolerance), on prompts with
repeated spans (proposals accepted) and random ones (proposals rejected: the KV rollback);
seeded sampling gives the tokens it gives without speculation; structured output and penalties give what the engine without
speculation gives. The engine's settings of test_parity (KV blocks of 4 tokens, prefill
chunks of 16) make verifications cross blocks and share the prefill call with prompts."""
import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from msinfer import LLM, SamplingParams  # noqa: E402
from test_parity import ENGINE, NEW_TOKENS, assert_matches_hf, case_spec, greedy  # noqa: E402

CASE = "gqa_untied_config4"  # test_parity's checkpoint (made once per session)
METHODS = {
    # n-grams of 1 .. 3: proposals on the random prompts too (mostly rejected)
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    # the target as its own draft: every proposal accepted unless it runs past the end
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
}


def grounded_prompts(vocab, seed=3):
    """A random 'document' and a cue that repeats its start, and a prompt of one token
    repeated: the n-gram and suffix proposers find matches in both; and a random prompt."""
    rng = np.random.default_rng(seed)
    document = rng.integers(0, vocab, size=24).tolist()
    return [document + document[:4], [7] * 6, rng.integers(0, vocab, size=9).tolist()]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, hf_model):
    model_dir, config = tiny_checkpoint(**case_spec(CASE))
    return model_dir, config, hf_model(model_dir)


@pytest.fixture(scope="module")
def plain(checkpoint):
    return LLM(checkpoint[0], **ENGINE)


@pytest.fixture(scope="module", params=sorted(METHODS))
def speculating(request, checkpoint):
    model_dir = checkpoint[0]
    settings = dict(METHODS[request.param])
    if settings["method"] == "draft_model":
        settings["model"] = model_dir
    return request.param, LLM(model_dir, **ENGINE, speculative_config=settings)


def test_greedy_tokens_and_logprobs_are_transformers(checkpoint, speculating):
    model_dir, config, hf = checkpoint
    method, llm = speculating
    prompts = grounded_prompts(config.vocab_size)
    outs = llm.generate(prompts, greedy(config.vocab_size))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert len(out.token_ids) == NEW_TOKENS
        assert_matches_hf(hf, prompt, out, config.vocab_size, f"{method} prompt {i}")
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.num_blocks_used == 0
    assert 0 <= stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    if method == "draft_model":  # its own draft: accepted unless past the end
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens


def test_seeded_sampling_repeats_and_penalties_and_grammar_are_kept(plain, speculating):
    method, llm = speculating
    prompts = grounded_prompts(plain.config.vocab_size, seed=4)
    sampled = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11 + i,
                              ignore_eos=True) for i in range(len(prompts))]
    # one uniform per emitted token as without speculation: the same tokens as the engine
    # without it, and so the same tokens again
    first = [o.token_ids for o in llm.generate(prompts, sampled)]
    assert first == [o.token_ids for o in plain.generate(prompts, sampled)], method
    assert [o.token_ids for o in llm.generate(prompts, sampled)] == first, method
    # what changes the scores, and a grammar, see the tokens accepted before each row
    shaped = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                             repetition_penalty=1.4, presence_penalty=0.7, logprobs=2),
              SamplingParams(max_tokens=20, temperature=0, min_tokens=5,
                             logit_bias={3: 4.0, 9: -100}),
              SamplingParams(max_tokens=20, temperature=0,
                             structured_outputs={"choice": ["alpha beta", "gamma"]})]
    expected = plain.generate(prompts, shaped)
    got = llm.generate(prompts, shaped)
    for want, have in zip(expected, got):
        assert (have.token_ids, have.text, have.finish_reason) == (
            want.token_ids, want.text, want.finish_reason), method
    assert got[2].text in ("alpha beta", "gamma")
    for want, have in zip(expected[0].logprobs, got[0].logprobs):
        assert want.keys() == have.keys()
        assert all(abs(want[t] - have[t]) < 1e-4 for t in want)


@pytest.mark.multirank(ranks=2)
def test_two_tensor_ranks_speculate_as_one_and_give_transformers_tokens(checkpoint,
                                                                        tmp_path_factory):
    """One mpirun job of two tensor ranks runs the checkpoint with n-grams, then with a draft
    model (the same directory, --model2): every rank proposes alike (the schedule digest
    covers the proposals), the leader decides and the follower settles its verifications
    from the leader's token lists; greedy tokens and logprobs equal on both ranks and
    transformers'. (Suffix decoding proposes on every rank as n-grams do, from the tokens
    alone: the engine tests above cover it.)"""
    from test_distributed import (PROMPTS, check_ranks_against_hf, mpirun_prefix, run_job,
                                  worker_args)

    model_dir, config, hf = checkpoint
    out_dir = tmp_path_factory.mktemp("spec_tp2")
    methods = [dict(METHODS["ngram"]), dict(METHODS["draft_model"], model=model_dir)]
    cmd = (mpirun_prefix(2) + [sys.executable]
           + worker_args(model_dir, "qwen2_tp2.yaml", out_dir)
           + ["--speculative-config", json.dumps(methods[0])])
    for method in methods[1:]:
        cmd += ["--model2", model_dir, "--model2-speculative-config", json.dumps(method)]
    code, out, _ = run_job(cmd)
    assert code == 0, out[-4000:]
    for number, results in enumerate(("npz", "model2.npz")):
        ranks = check_ranks_against_hf(out_dir, 2, hf, "mpirun-bridge", results=results)
        drafts, draft_tokens, accepted = ranks[0]["spec"].tolist()
        assert drafts > 0 and 0 <= accepted <= draft_tokens, methods[number]
        if number == 1:
            assert accepted >= 0.9 * draft_tokens  # its own draft
    assert max(map(len, PROMPTS)) > 16  # a prompt of several chunks beside verifications


def test_the_openai_server_streams_what_decoding_without_speculation_gives(plain,
                                                                           speculating):
    """The real engine of each method behind the OpenAI server (in process): a streamed
    greedy completion is the text without speculation, and steps that accept several tokens
    stream them in one chunk."""
    from test_serve_protocol import MODEL, RunningServer

    method, llm = speculating
    prompt = grounded_prompts(plain.config.vocab_size, seed=5)[0]
    expected = plain.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                       ignore_eos=True))[0]
    server = RunningServer(llm=llm)
    try:
        chunks = list(server.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True}))
    finally:
        server.stop()
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text, method
    assert chunks[-1].usage.completion_tokens == 24
    if method == "draft_model":  # its proposals accepted: fewer chunks than tokens
        assert len([c for c in chunks if c.choices]) < 20
