"""The model-free proposers of speculative decoding (engine/speculative/ngram.py, suffix.py):
exact proposals on hand-made token lists, and against references written from vLLM's and
Arctic Inference's algorithms over plain data structures (no index, no compressed tree)."""
from __future__ import annotations

import collections
import random

import pytest

from msinfer.engine.sampling import SamplingParams
from msinfer.engine.sequence import Sequence
from msinfer.engine.speculative import NgramProposer, SuffixProposer, build_proposer
from msinfer.engine.speculative.suffix_tree import SuffixTree
from msinfer.errors import MsinferError
from msinfer.speculative_config import SpeculativeConfig


def seq(tokens, prompt_len=None, request_id="r"):
    """A sequence whose prompt is tokens[:prompt_len] (all of it by default), the rest
    generated."""
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    s = Sequence(request_id, list(tokens[:prompt_len]), SamplingParams())
    s.generated.extend(tokens[prompt_len:])
    return s


def ngram(min_n, max_n, k=4):
    return NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                                           prompt_lookup_min=min_n, prompt_lookup_max=max_n))


def propose_ngram(tokens, min_n, max_n, k):
    return ngram(min_n, max_n, k).propose([seq(tokens)], [k])[0]


# ---- n-gram -----------------------------------------------------------------------------

# vLLM's own expectations (tests/v1/spec_decode/test_ngram.py: test_find_longest_matched_
# ngram_and_propose_tokens and test_ngram_proposer): tokens, min_n, max_n, k, proposal
VLLM_NGRAM_CASES = [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 2, [4, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # the earliest match
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram, not [5, 1]
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),  # the 3-gram, not [5, 2]
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
]


@pytest.mark.parametrize("tokens,min_n,max_n,k,expected", VLLM_NGRAM_CASES)
def test_ngram_matches_vllm_expectations(tokens, min_n, max_n, k, expected):
    assert propose_ngram(tokens, min_n, max_n, k) == expected


def reference_ngram(tokens, min_n, max_n, k):
    """vLLM v1's prompt lookup by brute force (vllm/v1/spec_decode/ngram_proposer.py: the
    longest n in [min_n, max_n] whose n-gram ends the tokens and occurs earlier, ending before
    the last token; its earliest occurrence; the up to k tokens after it)."""
    total = len(tokens)
    for n in range(min(max_n, total), min_n - 1, -1):
        pattern = tokens[total - n:]
        for start in range(0, total - n):
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_equals_the_reference_on_random_tokens_grown_step_by_step():
    rng = random.Random(0)
    for trial in range(60):
        vocab = rng.choice([2, 3, 5, 20])
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        s = seq(tokens)
        proposer = ngram(min_n, max_n, k)
        for _ in range(25):
            want = reference_ngram(s.prompt_token_ids + s.generated, min_n, max_n, k)
            assert proposer.propose([s], [k]) == [want], (trial, s.generated)
            assert ngram(min_n, max_n, k).propose([s], [k]) == [want]
            # one to three tokens a step, as accepted proposals arrive
            s.generated.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))


def test_ngram_count_limits_and_zero_count():
    tokens = [7, 8, 9, 10, 11, 7, 8]
    p = ngram(1, 2, k=5)
    assert p.propose([seq(tokens)], [5]) == [[9, 10, 11, 7, 8]]
    assert p.propose([seq(tokens)], [2]) == [[9, 10]]
    assert p.propose([seq(tokens)], [0]) == [[]]


def test_ngram_reads_prompt_and_output_and_finished_frees_state():
    p = ngram(2, 3, k=3)
    s = seq([5, 6, 7, 1, 2, 5, 6], prompt_len=4, request_id="a")
    other = seq([1, 2, 3], request_id="b")
    assert p.propose([s, other], [3, 3]) == [[7, 1, 2], []]
    assert set(p._index) == {"a", "b"}
    p.finished(s)
    assert set(p._index) == {"b"}


# ---- suffix decoding: the tree against plain counts ------------------------------------

def reference_counts(sequences, depth):
    """count[s] = occurrences of s (1 <= |s| <= depth) in the sequences: what the suffix tree
    represents (Arctic's SuffixTree: each suffix cut to max_depth, counted per node)."""
    counts = collections.Counter()
    for tokens in sequences:
        for i in range(len(tokens)):
            for n in range(1, min(depth, len(tokens) - i) + 1):
                counts[tuple(tokens[i:i + n])] += 1
    return counts


def reference_follow(counts, path, limit, min_prob):
    """Arctic's _speculate_path over plain counts: the most frequent next token (ties: the
    smaller id) while prob x count(next) / count(path) stays >= min_prob."""
    tokens, prob, score = [], 1.0, 0.0
    while len(tokens) < limit:
        options = [(c, -key[-1]) for key, c in counts.items()
                   if len(key) == len(path) + 1 and key[:-1] == path]
        if not options:
            break
        c, neg_token = max(options)
        if prob * c / counts[path] < min_prob:
            break
        prob *= c / counts[path]
        tokens.append(-neg_token)
        score += prob
        path += (-neg_token,)
    return tokens, score


def reference_best(counts, context, k, factor, min_prob):
    """Arctic's SuffixTree::speculate (path mode): match lengths 1 .. len(context) - 1, stop
    at the first unmatched one, keep the highest score (ties: the longer match)."""
    best, best_score = [], 0.0
    for m in range(1, len(context)):
        path = tuple(context[len(context) - m:])
        if not counts.get(path):
            break
        tokens, score = reference_follow(counts, path, min(k, int(m * factor + 1e-6)),
                                         min_prob)
        if score >= best_score:
            best, best_score = tokens, score
    return best, best_score


def tree_counts(tree):
    """count of every path of the tree, uncompressed."""
    counts = collections.Counter()

    def walk(node, path):
        for child in (node.children or {}).values():
            data = tree.seqs[child.seq]
            p = path
            for i in range(child.length):
                p = p + (data[child.start + i],)
                counts[p] = child.count
            walk(child, p)
    walk(tree.root, ())
    return counts


def test_suffix_tree_counts_equal_plain_counts_through_adds_and_removals():
    rng = random.Random(1)
    for trial in range(40):
        depth = rng.randint(1, 6)
        vocab = rng.choice([2, 3, 6])
        tree = SuffixTree(depth, removable=True)
        live = {}
        for step in range(12):
            if live and rng.random() < 0.3:
                sid = rng.choice(sorted(live))
                tree.remove(sid)
                del live[sid]
            else:
                sid = rng.randrange(6)
                new = [rng.randrange(vocab) for _ in range(rng.randint(0, 7))]
                tree.extend(sid, new)
                live.setdefault(sid, []).extend(new)
            want = reference_counts(live.values(), depth)
            assert tree_counts(tree) == +want, (trial, step)
            assert tree.root.count == sum(map(len, live.values()))
            for context in ([rng.randrange(vocab) for _ in range(depth)] for _ in range(3)):
                assert (tree_best(tree, context, 4, 1.5, 0.2)
                        == reference_best(want, context, 4, 1.5, 0.2))


def tree_best(tree, context, k, factor, min_prob):
    config = SpeculativeConfig(method="suffix", suffix_decoding_max_spec_factor=factor,
                               suffix_decoding_min_token_prob=min_prob)
    return SuffixProposer(config)._best_draft(tree, context, k)


# ---- suffix decoding: the proposer -----------------------------------------------------

def suffix(k=4, depth=24, cached=1000, factor=1.0, min_prob=0.1):
    return SuffixProposer(SpeculativeConfig(
        method="suffix", num_speculative_tokens=k, suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_cached_requests=cached, suffix_decoding_max_spec_factor=factor,
        suffix_decoding_min_token_prob=min_prob))


def test_suffix_proposes_the_continuation_of_the_longest_useful_match():
    # [1, 2] occurs twice (once at the end): 3 follows with probability 1/2; match length 2
    # allows 2 tokens (max_spec_factor 1): [3, 1]
    assert suffix().propose([seq([1, 2, 3, 1, 2])], [4]) == [[3, 1]]
    # max_spec_factor 2: four tokens from the same match
    assert suffix(factor=2.0).propose([seq([1, 2, 3, 1, 2])], [4]) == [[3, 1, 2]]
    # no repeat: nothing follows any suffix
    assert suffix().propose([seq([1, 2, 3, 4, 5])], [4]) == [[]]


def test_suffix_takes_the_most_frequent_continuation():
    # max_tree_depth 2: the context is the last two tokens, so only [5] is matched; 5 occurs
    # four times (once at the end), followed by 6 twice and 7 once
    assert suffix(depth=2, factor=4.0).propose([seq([5, 6, 0, 5, 7, 0, 5, 6, 0, 5])],
                                               [1]) == [[6]]
    assert suffix(depth=2, factor=4.0).propose([seq([5, 7, 0, 5, 6, 0, 5, 7, 0, 5])],
                                               [1]) == [[7]]
    # a tie (one 6, one 7): the smaller token
    assert suffix(depth=2, factor=4.0).propose([seq([5, 7, 0, 5, 6, 0, 5])], [1]) == [[6]]


def test_suffix_prefers_the_longer_match_on_equal_scores():
    # [5] -> 6 (2 of 4: score 0.5); [6, 0, 5] -> 7 (1 of 2: score 0.5): the longer match
    tokens = [5, 6, 0, 5, 7, 0, 5, 6, 0, 5]
    assert suffix(factor=4.0).propose([seq(tokens)], [1]) == [[7]]


def test_suffix_min_token_prob_cuts_the_draft():
    # [5] is matched (depth 2); 6, 7 and 8 each follow it with probability 1/4
    tokens = [5, 6, 0, 5, 7, 0, 5, 8, 0, 5]
    assert suffix(depth=2, min_prob=0.25, factor=4.0).propose([seq(tokens)], [1]) == [[6]]
    assert suffix(depth=2, min_prob=0.26, factor=4.0).propose([seq(tokens)], [1]) == [[]]
    # along a path: after [1, 2] (twice, once at the end) 3 has 1/2, then 4 keeps 1/2
    tokens = [1, 2, 3, 4, 1, 2]
    assert suffix(min_prob=0.5, factor=4.0).propose([seq(tokens)], [3]) == [[3, 4, 1]]
    assert suffix(min_prob=0.6, factor=4.0).propose([seq(tokens)], [3]) == [[]]


def test_suffix_uses_other_requests_outputs():
    p = suffix(factor=4.0)
    done = seq([100, 101, 10, 11, 12, 13, 14], prompt_len=2, request_id="done")
    assert p.propose([done], [4]) == [[]]
    p.finished(done)
    # a new request whose output begins like the finished one's
    new = seq([200, 10, 11], prompt_len=1, request_id="new")
    assert p.propose([new], [4]) == [[12, 13, 14]]
    # prompts do not enter the global tree: 100, 101 were the finished one's prompt
    probe = seq([300, 100], prompt_len=1, request_id="probe")
    assert p.propose([probe], [4]) == [[]]


def test_suffix_evicts_the_oldest_cached_output():
    p = suffix(cached=2, factor=4.0)
    for rid, first in (("a", 10), ("b", 20), ("c", 30)):
        s = seq([9, first, first + 1, first + 2], prompt_len=1, request_id=rid)
        p.propose([s], [4])
        p.finished(s)
    # "a" went when "c" started; outputs only (the prompt 9 is not there)
    assert sorted(p._global.seqs.values()) == [[20, 21, 22], [30, 31, 32]]
    assert p._global.root.count == 6
    probe = seq([8, 30], prompt_len=1, request_id="probe")
    assert p.propose([probe], [4]) == [[31, 32]]  # its start evicted "b"
    assert sorted(p._global.seqs.values()) == [[30], [30, 31, 32]]
    assert p.propose([seq([8, 20], prompt_len=1, request_id="probe2")], [4]) == [[]]


def test_suffix_incremental_equals_from_scratch_and_finished_frees_state():
    rng = random.Random(2)
    for trial in range(20):
        vocab = rng.choice([3, 5, 8])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(2, 15))]
        s = seq(tokens, prompt_len=rng.randint(1, len(tokens)))
        p = suffix(k=5, depth=rng.randint(2, 8), factor=rng.choice([0.5, 1.0, 3.0]))
        for _ in range(15):
            fresh = SuffixProposer(p_config(p))
            assert p.propose([s], [5]) == fresh.propose([s], [5]), trial
            s.generated.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
        p.finished(s)
        assert not p._requests


def p_config(p):
    return SpeculativeConfig(
        method="suffix", suffix_decoding_max_tree_depth=p.max_depth,
        suffix_decoding_max_cached_requests=p.max_cached,
        suffix_decoding_max_spec_factor=p.max_spec_factor,
        suffix_decoding_min_token_prob=p.min_token_prob)


def test_suffix_proposer_equals_the_reference_over_several_requests():
    """Own tree (prompt + output) and global tree (outputs of the cached requests) against
    plain counts, the better by score, own first on a tie (Arctic's SuffixDecodingCache)."""
    rng = random.Random(3)
    depth, k, factor, min_prob, cached = 5, 4, 1.0, 0.1, 3
    p = suffix(k=k, depth=depth, cached=cached, factor=factor, min_prob=min_prob)
    outputs = collections.OrderedDict()  # request -> its output, while cached
    running = []
    for step in range(120):
        if len(running) < 3 and rng.random() < 0.3:
            rid = f"r{step}"
            # first in the batch: its start evicts the oldest output before anyone proposes
            running.insert(0, seq([rng.randrange(4) for _ in range(rng.randint(1, 6))],
                                  request_id=rid))
            outputs[rid] = running[0].generated
            while len(outputs) > cached:
                outputs.popitem(last=False)
        if not running:
            continue
        before = {s.request_id: len(s.generated) for s in running}
        for s in running:
            s.generated.extend(rng.randrange(4) for _ in range(rng.randint(1, 2)))
        got = p.propose(running, [k] * len(running))
        for s, proposal in zip(running, got):
            tokens = s.prompt_token_ids + s.generated
            context = tokens[-depth:]
            want, score = reference_best(reference_counts([tokens], depth), context, k,
                                         factor, min_prob)
            # the global tree as it was when this sequence proposed: every running
            # sequence's new tokens are added before its own proposal
            view = global_view(outputs, running, s, before)
            other, other_score = reference_best(reference_counts(view, depth), context, k,
                                                factor, min_prob)
            if other_score > score:
                want = other
            assert proposal == want, step
        if rng.random() < 0.2:
            done = running.pop(rng.randrange(len(running)))
            p.finished(done)


def global_view(outputs, running, current, before):
    """The cached outputs as the global tree held them when `current` proposed: sequences
    later in the batch had not yet added this step's tokens (`before`: their lengths)."""
    order = [s.request_id for s in running]
    later = set(order[order.index(current.request_id) + 1:])
    return [output[:before[rid]] if rid in later else output
            for rid, output in outputs.items()]


def test_build_proposer_builds_ngram_and_suffix_and_refuses_the_rest():
    assert isinstance(build_proposer(SpeculativeConfig(method="ngram")), NgramProposer)
    assert isinstance(build_proposer(SpeculativeConfig(method="suffix")), SuffixProposer)
    with pytest.raises(MsinferError, match="draft_model"):
        build_proposer(SpeculativeConfig(method="draft_model", model="/some/draft"))
