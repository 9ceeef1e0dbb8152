"""Prompt logprobs (SamplingParams.prompt_logprobs: what echo and lm-eval's loglikelihood
tasks read) against transformers' Qwen2: every prompt token's log-probability within 1e-4 of
transformers' log_softmax and the top entries its argsort's, through prefill chunks (a
37-token prompt takes three 16-token chunks; rows beyond the largest batch go through its
lm_head in turn) and next to prompts that do not ask; in both runners (explicit, semi_auto).
The prefix cache never serves the positions a prompt needs scored; max_tokens 0 scores
without generating."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from msinfer import LLM, SamplingParams  # noqa: E402

TOLERANCE = 1e-4
TOP = 3
ENGINE = dict(max_len=64, block_size=4, max_prefill_tokens=16, max_num_seqs=2,
              kv_cache_memory=1 << 20)
SPEC = dict(layers=2, hidden=64, vocab=384, seed=1, heads=8, kv_heads=2, tie=False,
            config_style="4")  # test_parity's gqa_untied_config4


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()


def assert_prompt_logprobs_match(hf, prompt, scored, top=TOP):
    reference = hf_logprobs(hf, prompt)
    assert scored[0] is None and len(scored) == len(prompt)
    for i in range(1, len(prompt)):
        row = reference[i - 1]  # position i - 1 scores token i
        entry = scored[i]
        assert entry[prompt[i]] == pytest.approx(row[prompt[i]], abs=TOLERANCE), i
        best = [int(t) for t in np.argsort(-row, kind="stable")[:top]]
        assert set(entry) == set(best) | {prompt[i]}, (i, entry, best)
        for t in best:
            assert entry[t] == pytest.approx(row[t], abs=TOLERANCE)


@pytest.fixture(scope="module", params=["explicit", "semi_auto"])
def llm_and_hf(request, tiny_checkpoint, hf_model):
    model_dir, config = tiny_checkpoint(**SPEC)
    return LLM(model_dir, parallel_mode=request.param, **ENGINE), hf_model(model_dir), config


def prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def test_prompt_logprobs_match_transformers_over_chunks_beside_plain_prompts(llm_and_hf):
    llm, hf, config = llm_and_hf
    scored_params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                   prompt_logprobs=TOP, logprobs=1)
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    batch = prompts(config.vocab_size, (37, 5, 11, 1))
    outs = llm.generate(batch, [scored_params, plain, scored_params, scored_params])
    for i in (0, 2, 3):
        assert_prompt_logprobs_match(hf, batch[i], outs[i].prompt_logprobs)
        # the generated tokens are greedy as without prompt logprobs
        expected = hf_logprobs(hf, batch[i] + outs[i].token_ids)[len(batch[i]) - 1:-1]
        assert outs[i].token_ids == expected.argmax(-1).tolist()
    assert outs[1].prompt_logprobs is None
    alone = llm.generate([batch[1]], plain)[0]
    assert alone.token_ids == outs[1].token_ids


def test_the_prefix_cache_never_serves_positions_to_score(llm_and_hf):
    """A prompt seen before is computed again when it asks for prompt logprobs (its cached
    blocks have no logits; vLLM does the same), and gives the same numbers; asked without,
    the same prompt is served from the cache."""
    llm, hf, config = llm_and_hf
    prompt = prompts(config.vocab_size, (30,), seed=4)[0]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP)
    first = llm.generate([prompt], params)[0]
    computed = llm.engine.prefill_tokens_computed
    again = llm.generate([prompt], params)[0]
    assert again.cached_tokens == 0
    assert llm.engine.prefill_tokens_computed - computed == len(prompt)
    assert again.prompt_logprobs == first.prompt_logprobs
    assert_prompt_logprobs_match(hf, prompt, again.prompt_logprobs)
    plain = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.cached_tokens == 28  # 7 full blocks of 4, never the last token


def test_max_tokens_0_scores_the_prompt_without_generating(llm_and_hf):
    llm, hf, config = llm_and_hf
    prompt = prompts(config.vocab_size, (20,), seed=6)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length" and out.finished
    assert_prompt_logprobs_match(hf, prompt, out.prompt_logprobs, top=0)
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])
    assert llm.engine.stats().num_blocks_used == 0


def test_max_tokens_0_needs_prompt_logprobs():
    from msinfer.errors import MsinferError
    with pytest.raises(MsinferError, match="max_tokens=0 .*0 only with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(MsinferError, match="prompt_logprobs=-1"):
        SamplingParams(prompt_logprobs=-1)
