"""The engine's logprobs (`sampling.logprobs_of_rows`): its partial selection of the top
entries (candidates bounded by block maxima) gives what sorting the whole row in float64
gives: the same tokens in the same order (ties by id), values within 1e-6 (its log-sum-exp
sums float32 exponentials), row by row or many rows at once."""
import numpy as np
import pytest

from msinfer.engine.sampling import logprobs_of_rows


def _logprobs(logits, token, top):
    """logprobs_of_rows of one row."""
    return logprobs_of_rows(np.asarray(logits)[None], [token], top)[0]


def full_sort(logits, token, top):
    """The reference: the whole row's log-probabilities, sorted (msinfer before 0.2.x)."""
    row = logits.astype(np.float64)
    shifted = row - row.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    picked = {token: float(logprobs[token])}
    if top:
        for t in np.argsort(-logprobs, kind="stable")[:top]:
            picked.setdefault(int(t), float(logprobs[t]))
    return picked


def rows():
    rng = np.random.default_rng(7)
    yield "random", (rng.standard_normal((8, 151936)) * 3).astype(np.float32)
    yield "many ties", rng.integers(-3, 3, (8, 5000)).astype(np.float32)
    yield "all equal", np.zeros((2, 64), np.float32)
    yield "float16", (rng.standard_normal((4, 3000)) * 4).astype(np.float16)
    yield "tiny vocabulary", rng.standard_normal((3, 4)).astype(np.float32)
    clustered = rng.standard_normal((3, 151936)).astype(np.float32)
    clustered[0, 768:800] += 10  # the top ones in one block
    clustered[1, -30:] += 10  # in the tail beyond the last whole block
    clustered[2, ::256] += 10  # one in each block, at its start
    yield "clustered", clustered


@pytest.mark.parametrize("top", [0, 1, 5, 20])
@pytest.mark.parametrize("name, logits", list(rows()), ids=lambda x: x if isinstance(x, str)
                         else "")
def test_partial_selection_equals_the_full_sort(name, logits, top):
    rng = np.random.default_rng(top)
    for row in logits:
        for token in (int(np.argmax(row)), int(rng.integers(len(row)))):
            got, want = _logprobs(row, token, top), full_sort(row, token, top)
            assert list(got) == list(want), name
            assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-6), name


@pytest.mark.parametrize("top", [0, 3])
def test_many_rows_at_once_are_each_row_alone(top):
    logits = (np.random.default_rng(3).standard_normal((9, 70000)) * 3).astype(np.float32)
    tokens = list(range(9))
    assert logprobs_of_rows(logits, tokens, top) == [_logprobs(row, t, top)
                                                     for row, t in zip(logits, tokens)]


def test_the_values_are_log_probabilities():
    row = np.log(np.array([0.5, 0.25, 0.125, 0.125], np.float32))
    assert _logprobs(row, 3, 2) == pytest.approx({3: np.log(0.125), 0: np.log(0.5),
                                                  1: np.log(0.25)})
