import re

import numpy as np
import pytest

from msinfer import SamplingParams as ExportedSamplingParams
from msinfer.engine.sampling import Sampler, SamplingParams, adjust_scores
from msinfer.errors import MsinferError


def sample_many(logits_row, params, draws=4000, seed=0):
    logits = np.tile(np.asarray(logits_row, dtype=np.float32), (draws, 1))
    rng = np.random.default_rng(seed)
    return Sampler()(logits, [params] * draws, [rng] * draws)


def test_package_exports_the_same_class():
    assert ExportedSamplingParams is SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (16, 1.0, 0, 1.0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ((), (), False)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("max_tokens", 0), ("max_tokens", 2.5), ("top_k", -2), ("seed", -1), ("stop", ("",)),
    ("stop_token_ids", (-1,)),
])
def test_bad_value_is_refused_naming_field_and_value(field, value):
    with pytest.raises(MsinferError, match=re.escape(f"{field}={value!r}")):
        SamplingParams(**{field: value})


def test_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)


def test_greedy_takes_argmax_per_row_and_lowest_id_on_ties():
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, 1.0, 5.0, 0.0]], dtype=np.float32)
    params = [SamplingParams(temperature=0)] * 2
    assert Sampler()(logits, params, [None, None]).tolist() == [1, 0]


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = np.array([[0.0, 9.0, 0.0], [0.0, 0.0, 50.0], [7.0, 0.0, 0.0]], dtype=np.float32)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0)]
    rngs = [None, np.random.default_rng(0), None]
    assert Sampler()(logits, params, rngs).tolist() == [1, 2, 0]


def test_same_seed_gives_same_tokens_and_other_seed_differs():
    logits = np.random.default_rng(1).standard_normal((1, 1000)).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=42)

    def run(p):
        rng = p.new_generator()
        return [int(Sampler()(logits, [p], [rng])[0]) for _ in range(20)]

    assert run(params) == run(params)
    assert run(params) != run(SamplingParams(temperature=1.0, seed=43))


def test_top_k_only_draws_from_the_k_best():
    logits = np.arange(10, dtype=np.float32)  # token 9 best
    tokens = sample_many(logits, SamplingParams(temperature=5.0, top_k=3))
    assert set(tokens.tolist()) == {7, 8, 9}


def test_top_k_keeps_tokens_tied_with_the_kth():
    logits = [0.0, 1.0, 1.0, 1.0, -5.0]
    tokens = sample_many(logits, SamplingParams(top_k=2), draws=2000)
    assert set(tokens.tolist()) == {1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)
    # mass above token 2 is 0.8: kept for top_p=0.85, dropped for top_p=0.8
    assert set(sample_many(logits, SamplingParams(top_p=0.85)).tolist()) == {0, 1, 2}
    assert set(sample_many(logits, SamplingParams(top_p=0.8)).tolist()) == {0, 1}


def test_tiny_top_p_always_keeps_the_best_token():
    tokens = sample_many([1.0, 3.0, 2.0], SamplingParams(top_p=1e-9), draws=100)
    assert set(tokens.tolist()) == {1}


def test_top_p_over_a_large_vocab_matches_a_full_sort():
    # Flat logits put the nucleus beyond the cheap candidate sets: the full-sort path runs too.
    for scale in (8.0, 0.01):
        logits = np.random.default_rng(3).standard_normal(5000) * scale
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs)
        allowed = set(order[(np.cumsum(probs[order]) - probs[order]) < 0.9].tolist())
        tokens = sample_many(logits, SamplingParams(top_p=0.9), draws=3000)
        assert set(tokens.tolist()) <= allowed
        assert len(set(tokens.tolist())) > min(len(allowed), 3000) // 4


def test_sampled_frequencies_follow_softmax_of_scaled_logits():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    tokens = sample_many(logits, SamplingParams(temperature=0.5), draws=20000)
    expected = np.array([0.6, 0.3, 0.1]) ** 2
    expected /= expected.sum()
    observed = np.bincount(tokens, minlength=3) / tokens.size
    np.testing.assert_allclose(observed, expected, atol=0.015)


def test_top_k_and_top_p_apply_after_temperature_like_hf():
    # At temperature 0.25, p = [0.5, 0.3, 0.2] ** 4 normalised: token 0 alone holds > 0.7.
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    tokens = sample_many(logits, SamplingParams(temperature=0.25, top_p=0.7), draws=500)
    assert set(tokens.tolist()) == {0}


def test_extreme_logits_do_not_overflow():
    logits = np.array([1e30, -1e30, 0.0], dtype=np.float32)
    tokens = sample_many(logits, SamplingParams(temperature=1e-3), draws=50)
    assert set(tokens.tolist()) == {0}


def test_mismatched_batch_is_refused():
    with pytest.raises(ValueError, match="one SamplingParams"):
        Sampler()(np.zeros((2, 4), np.float32), [SamplingParams()], [None])


# ---- what changes the scores before sampling: against HF's processors and OpenAI's formula

def _hf_processed(processor, row, ids):
    torch = pytest.importorskip("torch")
    scores = torch.tensor(np.asarray(row, np.float32)[None, :])
    return processor(torch.tensor([ids]), scores)[0].numpy()


def _scores(vocab=64, seed=3):
    return np.random.default_rng(seed).normal(0, 3, vocab).astype(np.float32)


def test_repetition_penalty_is_hfs_over_prompt_and_output():
    transformers = pytest.importorskip("transformers")
    row, prompt, generated = _scores(), [1, 5, 9, 5], [9, 12, 30]
    ours = adjust_scores(row, SamplingParams(repetition_penalty=1.7), prompt, generated)
    hf = _hf_processed(transformers.RepetitionPenaltyLogitsProcessor(1.7), row,
                       prompt + generated)
    np.testing.assert_allclose(ours, hf, rtol=1e-6)
    assert (ours != row).sum() == len(set(prompt + generated))


def test_presence_and_frequency_penalties_follow_openais_formula():
    """OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c counted
    over the output only (as vLLM)."""
    row, prompt, generated = _scores(), [2, 3], [4, 4, 4, 7, 2]
    ours = adjust_scores(row, SamplingParams(frequency_penalty=0.5, presence_penalty=-1.25),
                         prompt, generated)
    expected = row.astype(np.float64).copy()
    for j in range(row.size):
        c = generated.count(j)
        expected[j] -= c * 0.5 + (c > 0) * -1.25
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    assert ours[3] == row[3]  # in the prompt only: untouched


def test_min_tokens_masks_eos_and_stop_tokens_until_reached_like_hf():
    transformers = pytest.importorskip("transformers")
    row = _scores()
    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[11])
    early = adjust_scores(row, params, [1, 2], [5, 6], eos_token_ids={0})
    hf = _hf_processed(transformers.MinNewTokensLengthLogitsProcessor(
        prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=[0, 11]), row, [1, 2, 5, 6])
    np.testing.assert_array_equal(early, hf)
    assert np.isinf(early[[0, 11]]).all()
    assert (adjust_scores(row, params, [1, 2], [5, 6, 7], eos_token_ids={0}) == row).all()
    ignoring = SamplingParams(max_tokens=8, min_tokens=3, ignore_eos=True)
    assert adjust_scores(row, ignoring, [1], [], eos_token_ids={0})[0] == row[0]


def test_logit_bias_takes_openais_string_keys_and_forces_or_bans_tokens():
    params = SamplingParams(temperature=0, logit_bias={"7": 100, 3: -100})
    assert params.logit_bias == {7: 100.0, 3: -100.0}
    row = _scores()
    row[3] = row.max() + 50
    tokens = Sampler()(np.stack([row, row]), [params, SamplingParams(temperature=0)],
                       [None, None], [([1], []), ([1], [])])
    assert tokens.tolist() == [7, 3]  # the biased row only; the caller's logits unchanged
    assert row[3] == row.max()


def test_min_p_keeps_what_hfs_min_p_warper_keeps():
    transformers = pytest.importorskip("transformers")
    row = _scores(vocab=200)
    kept_hf = np.isfinite(_hf_processed(transformers.MinPLogitsWarper(0.05), row, [0]))
    drawn = set(sample_many(row, SamplingParams(min_p=0.05), draws=3000).tolist())
    assert drawn <= set(np.flatnonzero(kept_hf).tolist())
    assert len(drawn) > 1


def test_greedy_rows_take_the_argmax_after_the_penalties():
    row = np.zeros(16, np.float32)
    row[4], row[5] = 2.0, 1.9
    tokens = Sampler()(row[None, :], [SamplingParams(temperature=0, presence_penalty=0.5)],
                       [None], [([1], [4])])
    assert tokens.tolist() == [5]


@pytest.mark.parametrize("field, value", [
    ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("min_tokens", -1), ("min_tokens", 17),
])
def test_bad_score_changes_are_refused_naming_the_field(field, value):
    with pytest.raises(MsinferError, match=re.escape(f"{field}={value!r}")) as error:
        SamplingParams(**{field: value})
    assert error.value.field == field
