"""Speculative decoding in the engine, on the host with a stub model whose logits at each
position are a fixed function of the tokens up to it (as a causal model's are): verifying
proposals must give what decoding without them gives: the same greedy tokens and logprobs,
stop strings and penalties honoured, seeded sampling reproducible, the target's distribution
kept by the acceptance rule, the rejected positions' blocks given back."""
import hashlib

import numpy as np
import pytest

from fake_engine import stub_engine_config
from msinfer.engine import LLMEngine
from msinfer.engine.sampling import SamplingParams
from msinfer.engine.speculative.proposer import Proposer
from msinfer.engine.speculative.verify import accepted_count, decide
from msinfer.engine_config import EngineLimits
from msinfer.planning.kv_layout import CacheLayout
from msinfer.speculative_config import SpeculativeConfig

VOCAB = 32
K = 4


def row_for(prefix):
    """The stub model's logits after `prefix`: peaked (one likely token), drawn from a hash
    of the prefix."""
    digest = hashlib.blake2b(repr(list(prefix)).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return (rng.standard_normal(VOCAB) * 2.5).astype(np.float32)


class CausalStub:
    def __init__(self):
        self.calls = []

    def decode(self, seqs):
        self.calls.append(("decode", len(seqs)))
        return np.stack([row_for(s.token_slice(0, s.length)) for s in seqs])

    def prefill(self, chunks):
        self.calls.append(("prefill", sum(c.count for c in chunks)))
        rows = []
        for c in chunks:
            tokens = c.seq.token_slice(0, c.start) + c.token_ids()
            rows += [row_for(tokens[:p + 1]) for p in c.logit_positions()]
        return np.stack(rows) if rows else np.zeros((0, VOCAB), np.float32)


class LetterTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


class Replay(Proposer):
    """Proposes what a run without speculation generated (`reference`: request id -> tokens),
    every `corrupt`-th proposal with one token changed; records what it was told."""

    def __init__(self, reference, corrupt=3):
        self.reference, self.corrupt, self.calls, self.done = reference, corrupt, 0, []

    def propose(self, seqs, counts):
        out = []
        for seq, count in zip(seqs, counts):
            at = len(seq.generated)
            proposal = list(self.reference[seq.request_id][at:at + count])
            self.calls += 1
            if self.corrupt and self.calls % self.corrupt == 0 and len(proposal) > 1:
                proposal[1] = (proposal[1] + 1) % VOCAB
            out.append(proposal)
        return out

    def finished(self, seq):
        self.done.append(seq.request_id)


class Garbage(Proposer):
    def propose(self, seqs, counts):
        return [[(s.last_token * 7 + 3 + i) % VOCAB for i in range(c)]
                for s, c in zip(seqs, counts)]


def engine(proposer=None, num_blocks=200, max_num_seqs=4, **spec):
    layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=4, block_size=4,
                         num_blocks=num_blocks, dtype_bytes=4)
    limits = EngineLimits(max_model_len=256, max_num_seqs=max_num_seqs, max_prefill_tokens=64,
                          block_size=4)
    config = (SpeculativeConfig(method="ngram", num_speculative_tokens=K, **spec)
              if proposer is not None else None)
    return LLMEngine(CausalStub(), layout,
                     stub_engine_config(limits, VOCAB, speculative=config),
                     eos_token_ids=[VOCAB + 1], seed=0, tokenizer=LetterTokenizer,
                     proposer=proposer)


PROMPTS = {"a": [1, 2, 3], "b": [5] * 9, "c": list(range(20)), "d": [7, 1]}


def run(e, params, prompts=PROMPTS, check=None):
    for rid, ids in prompts.items():
        e.add_request(rid, ids, params(rid) if callable(params) else params)
    final = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                final[out.request_id] = out
        if check:
            check(e)
    return final


def greedy(rid):
    return SamplingParams(max_tokens=30 + len(rid), temperature=0, ignore_eos=True, logprobs=2,
                          stop=["zz"] if rid == "d" else (),
                          repetition_penalty=1.3 if rid == "b" else 1.0,
                          presence_penalty=0.5 if rid == "c" else 0.0)


def test_greedy_tokens_logprobs_and_stops_equal_decoding_without_proposals():
    base = run(engine(), greedy)
    reference = {rid: list(out.token_ids) for rid, out in base.items()}
    for proposer in (Replay(reference), Replay(reference, corrupt=0), Garbage()):
        e = engine(proposer)
        held = []
        spec = run(e, greedy, check=lambda e: held.append(e.blocks.num_used))
        for rid, out in base.items():
            got = spec[rid]
            assert list(got.token_ids) == list(out.token_ids), (proposer, rid)
            assert got.finish_reason == out.finish_reason and got.text == out.text
            for mine, theirs in zip(got.logprobs, out.logprobs):
                assert mine.keys() == theirs.keys()
                assert all(abs(mine[t] - theirs[t]) < 1e-5 for t in mine)
        stats = e.stats()
        assert e.blocks.num_used == 0 and stats.spec_num_drafts > 0
        assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
        per_pos = stats.spec_accepted_per_pos
        assert sum(per_pos) == stats.spec_num_accepted_tokens
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
        if isinstance(proposer, Garbage):
            assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens // 4
        else:
            assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens // 2
            # fewer steps than tokens: several tokens per verification
            assert e.step_count < sum(len(o.token_ids) for o in spec.values()) / 2
            assert sorted(proposer.done) == sorted(PROMPTS)


def test_a_stop_string_ends_the_run_where_decoding_ends_it():
    def params(stop=()):
        return SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stop)

    unstopped = run(engine(), params())
    plain = unstopped["c"].text
    stop = plain[14:16]  # met by a token in the middle of some verification's run
    base = run(engine(), params([stop]))
    reference = {rid: list(out.token_ids) for rid, out in unstopped.items()}
    spec = run(engine(Replay(reference, corrupt=0)), params([stop]))
    assert base["c"].finish_reason == "stop" and base["c"].text == plain[:plain.index(stop)]
    for rid, out in base.items():
        assert (list(spec[rid].token_ids), spec[rid].text, spec[rid].finish_reason) == (
            list(out.token_ids), out.text, out.finish_reason)


def test_a_garbage_proposer_backs_off_instead_of_verifying_every_step():
    e = engine(Garbage())
    run(e, greedy)
    stats = e.stats()
    generated = stats.generation_tokens_total
    # without the back-off every step of every sequence would verify
    assert stats.spec_num_drafts < generated / 3


def test_no_speculation_beyond_the_batch_bound():
    base = run(engine(), greedy)
    reference = {rid: list(out.token_ids) for rid, out in base.items()}
    e = engine(Replay(reference, corrupt=0), disable_by_batch_size=2)
    spec = run(e, greedy)
    assert {r: list(o.token_ids) for r, o in spec.items()} == reference
    # 4 sequences decode together at first: no verifications until two are done
    assert e.stats().spec_num_drafts < sum(len(t) for t in reference.values()) / 2


def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation():
    def sampled(rid):
        return SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=ord(rid),
                              ignore_eos=True)

    base = run(engine(), sampled)
    reference = {rid: list(out.token_ids) for rid, out in base.items()}
    # one uniform per emitted token, as a decode step draws it: what was proposed, accepted
    # or not, leaves a seeded request's tokens as they are without speculation
    for proposer in (Replay(reference), Garbage()):
        spec = run(engine(proposer), sampled)
        assert {r: list(o.token_ids) for r, o in spec.items()} == reference
    assert engine(Replay(reference)).speculation is not None


def test_preempted_sequences_with_proposals_still_decode_alike():
    base = run(engine(num_blocks=200), greedy)
    reference = {rid: list(out.token_ids) for rid, out in base.items()}
    e = engine(Replay(reference), num_blocks=24)  # 23 blocks of 4 tokens for 4 sequences
    spec = run(e, greedy)
    assert {r: list(o.token_ids) for r, o in spec.items()} == reference
    assert e.stats().num_preemptions > 0 and e.blocks.num_used == 0


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_the_acceptance_rule_keeps_the_target_distribution(temperature, top_k):
    """The acceptance rule against a one-token proposal: the emitted token is distributed as
    the target's sampling distribution whatever is proposed (a likely token, an unlikely one,
    one outside top-k). 20,000 draws per proposal; a fixed seed makes the test exact."""
    from msinfer.engine.sampling import Sampler, row_distribution

    scores = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2], np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k)
    ids, probs = row_distribution(scores, params)
    target = np.zeros(scores.size)
    target[ids] = probs
    rng = np.random.default_rng(1234)
    sampler = Sampler()
    for proposed in (0, 3, 5):
        counts = np.zeros(scores.size)
        for _ in range(20000):
            token, _ = decide(sampler, scores, params, rng, proposed)
            counts[token] += 1
        share = counts / counts.sum()
        # 4.5 standard errors of a binomial share: a wrong rule (e.g. always accepting)
        # is off by far more
        assert np.all(np.abs(share - target) <= 4.5 * np.sqrt(target * (1 - target) / 20000)
                      + 1e-9), (proposed, share, target)


def test_accepted_count_is_the_common_prefix():
    assert accepted_count([4, 5, 9], (4, 5, 6, 7)) == 2
    assert accepted_count([4, 5, 6, 7, 8], (4, 5, 6, 7)) == 4
    assert accepted_count([1], (4,)) == 0


def test_the_next_proposal_is_as_long_as_the_last_one_earned():
    from types import SimpleNamespace

    from msinfer.engine.speculative.adaptive import ProposalBudget

    budget = ProposalBudget(SpeculativeConfig(method="ngram", num_speculative_tokens=8))
    seq = SimpleNamespace(request_id="a", params=SimpleNamespace(max_tokens=100),
                          generated=[], length=10)

    def wanted():  # a new step
        budget.new_step()
        return budget.wanted(seq, 1, 256)

    assert wanted() == 8
    budget.proposed(seq, 8, 3)  # some accepted: one more than were
    assert wanted() == 4
    budget.proposed(seq, 4, 4)  # all: twice as many, up to k
    assert wanted() == 8
    budget.proposed(seq, 8, 0)  # none (step 3): one token, 2 steps later, in an even step
    assert [wanted(), wanted(), wanted()] == [0, 0, 1]
    budget.proposed(seq, 1, 0)  # none again (step 6): 4 steps later, a multiple of 4
    assert [wanted() for _ in range(6)] == [0, 0, 0, 0, 0, 1]
    budget.proposed(seq, 1, 1)
    assert wanted() == 2
    seq.generated = [0] * 98  # two tokens left: one proposal and the token after it
    assert wanted() == 1
    assert budget.wanted(seq, 9, 256) == 0  # beyond the batch bound (8)


def test_sequences_backing_off_alike_try_again_in_the_same_step():
    """After misses in different steps, two sequences at the same back-off propose again
    together, in a step whose number is a multiple of it (one verification step for both,
    not one each)."""
    from types import SimpleNamespace

    from msinfer.engine.speculative.adaptive import ProposalBudget

    budget = ProposalBudget(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    a, b = (SimpleNamespace(request_id=r, params=SimpleNamespace(max_tokens=500),
                            generated=[], length=10) for r in "ab")
    tries = {"a": [], "b": []}
    for step in range(1, 120):
        budget.new_step()
        for seq in (a, b):
            if step < 3 and seq is b:
                continue  # b starts two steps later
            if budget.wanted(seq, 2, 1024):
                tries[seq.request_id].append(step)
                budget.proposed(seq, 1, 0)  # every proposal missed
    # back-offs 2, 4 ... 32: a tries in steps 1, 4, 8, 16, 32, 64, b in 3, 6, 12, 24, 48,
    # 96; then both every 32 steps, together
    assert tries["a"][:6] == [1, 4, 8, 16, 32, 64] and tries["b"][:6] == [3, 6, 12, 24, 48, 96]
    assert tries["a"][6:] == tries["b"][5:] == [96]



def test_decodes_ride_with_verifications_in_one_call():
    """A step where some sequences verify runs the others' one token in the same prefill
    call (no decode call beside it), and counts them as decoded, not prefilled."""
    base = run(engine(), greedy)
    reference = {rid: list(out.token_ids) for rid, out in base.items()}

    class OnlyA(Replay):  # proposes for "a" only: the others ride
        def propose(self, seqs, counts):
            return [p if s.request_id == "a" else []
                    for s, p in zip(seqs, super().propose(seqs, counts))]

    e = engine(OnlyA(reference, corrupt=0))
    spec = run(e, greedy)
    assert {r: list(o.token_ids) for r, o in spec.items()} == reference
    calls = e.runner.calls
    # while "a" verifies 4 proposals, the three others' tokens ride in its call (5 + 3); once
    # it is done they decode: no step ran a verification call and a decode call
    assert ("prefill", 8) in calls
    first_decode = calls.index(("decode", 3))
    assert all(kind == "decode" for kind, _ in calls[first_decode:])
    assert e.prefill_tokens_computed == sum(map(len, PROMPTS.values()))
