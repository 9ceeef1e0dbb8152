"""Scoring through the session's real server (conftest's `tiny_server`, no server of its
own): best_of returns the n of its sequences with the highest cumulative logprob, and a
prompt scored twice (echo, prompt_logprobs) is computed again, never served by the prefix
cache, with the same numbers. lm-eval's use of echo is tests/server/test_client_lm_eval.py's."""
import httpx2 as httpx
import pytest

from servers import NAME

pytestmark = pytest.mark.server


def complete(server, **body):
    response = httpx.post(server.url + "/v1/completions", json={"model": NAME, **body},
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_best_of_returns_the_sequences_with_the_highest_cumulative_logprob(tiny_server):
    """Sequence j of a seeded request draws from seed + j whether it is a choice (n) or a
    candidate (best_of): n=3 shows the three candidates best_of=3 picks from."""
    sampled = dict(prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11,
                   ignore_eos=True)
    all_three = complete(tiny_server, n=3, logprobs=0, **sampled)
    ranked = sorted(all_three["choices"],
                    key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert len({c["text"] for c in ranked}) > 1  # the candidates differ
    best = complete(tiny_server, best_of=3, n=1, **sampled)
    assert [c["text"] for c in best["choices"]] == [ranked[0]["text"]]
    assert best["choices"][0]["logprobs"] is None  # not asked for
    assert best["usage"]["completion_tokens"] == 18  # every candidate's tokens count
    two = complete(tiny_server, best_of=3, n=2, logprobs=1, **sampled)
    assert [c["text"] for c in two["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in two["choices"]] == [0, 1]


def test_a_prompt_scored_twice_is_computed_twice_with_the_same_numbers(tiny_server):
    prompt = "A prompt long enough to fill several cache blocks, scored twice."
    first = complete(tiny_server, prompt=prompt, echo=True, logprobs=2, max_tokens=0,
                     prompt_logprobs=1)
    again = complete(tiny_server, prompt=prompt, echo=True, logprobs=2, max_tokens=0,
                     prompt_logprobs=1)
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    assert again["choices"][0]["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["text"] == prompt and again["usage"]["completion_tokens"] == 0
    scored = first["choices"][0]["logprobs"]["token_logprobs"]
    assert scored[0] is None and len(scored) == first["usage"]["prompt_tokens"]
    assert all(value < 0 for value in scored[1:])
    # without prompt logprobs, the same prompt is served from the cache
    plain = complete(tiny_server, prompt=prompt, max_tokens=1)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_n_choices_of_one_prompt_compute_its_full_blocks_once(tiny_server):
    """n = 4 on a 40-token prompt (blocks of 16): the first choice computes all 40 tokens,
    the others take its two full blocks from the prefix cache in the same step and compute
    only the 8 of the last, partial block (vLLM's prefix cache shares full blocks too)."""
    prompt = list(range(300, 340))  # token ids no other test sends
    before = tiny_server.metric("msinfer_prefill_tokens_computed_total")
    out = complete(tiny_server, prompt=prompt, n=4, max_tokens=3, temperature=1.0, seed=5)
    assert len(out["choices"]) == 4
    assert out["usage"]["prompt_tokens"] == 40, out["usage"]  # counted once, as OpenAI's
    assert tiny_server.metric("msinfer_prefill_tokens_computed_total") - before == 40 + 3 * 8
