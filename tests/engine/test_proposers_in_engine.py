"""The n-gram and suffix proposers driving the engine's speculative decoding, on the host with
a stub model that often copies what followed the last token's previous occurrence (as an
induction head does), so proposals drawn from the text are often right: greedy output equals
decoding without speculation, proposals are accepted, the proposers' state is freed, and a
seeded sampled request's output does not depend on what ran beside it."""
import hashlib

import numpy as np
import pytest

from fake_engine import stub_engine_config
from msinfer.engine import LLMEngine
from msinfer.engine.sampling import SamplingParams
from msinfer.engine_config import EngineLimits
from msinfer.planning.kv_layout import CacheLayout
from msinfer.speculative_config import SpeculativeConfig

VOCAB = 24


def row_for(prefix):
    """Logits after `prefix`: a peaked row drawn from a hash of the prefix, plus a bonus for
    the token that followed the last token's latest earlier occurrence."""
    digest = hashlib.blake2b(repr(list(prefix)).encode(), digest_size=8).digest()
    row = np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(VOCAB) * 2.0
    last = prefix[-1]
    for i in range(len(prefix) - 2, -1, -1):
        if prefix[i] == last:
            row[prefix[i + 1]] += 6.0
            break
    return row.astype(np.float32)


class CopyStub:
    def decode(self, seqs):
        return np.stack([row_for(s.token_slice(0, s.length)) for s in seqs])

    def prefill(self, chunks):
        rows = []
        for c in chunks:
            tokens = c.seq.token_slice(0, c.start) + c.token_ids()
            rows += [row_for(tokens[:p + 1]) for p in c.logit_positions()]
        return np.stack(rows) if rows else np.zeros((0, VOCAB), np.float32)


def engine(spec=None, proposer=None):
    layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=4, block_size=4, num_blocks=300,
                         dtype_bytes=4)
    limits = EngineLimits(max_model_len=256, max_num_seqs=4, max_prefill_tokens=64,
                          block_size=4)
    config = SpeculativeConfig.parse(spec)
    return LLMEngine(CopyStub(), layout, stub_engine_config(limits, VOCAB, speculative=config),
                     eos_token_ids=[VOCAB + 1], seed=0, proposer=proposer)


PROMPTS = {"a": [1, 2, 3, 4, 5, 1, 2], "b": [7, 8, 9, 7, 8, 9, 7], "c": list(range(12)),
           "d": [3, 1, 4, 1, 5, 9, 2, 6]}


def run(e, params, prompts=PROMPTS):
    for rid, ids in prompts.items():
        e.add_request(rid, ids, params(rid))
    final = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                final[out.request_id] = list(out.token_ids)
    return final


def greedy(rid):
    return SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


METHODS = [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4},
           {"method": "suffix", "num_speculative_tokens": 4},
           {"method": "suffix", "num_speculative_tokens": 6,
            "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_max_cached_requests": 2}]


@pytest.fixture(scope="module")
def plain_greedy():
    return run(engine(), greedy)


@pytest.mark.parametrize("spec", METHODS, ids=lambda s: s["method"])
def test_greedy_output_equals_decoding_without_speculation(spec, plain_greedy):
    e = engine(spec)
    assert run(e, greedy) == plain_greedy
    stats = e.stats()
    # the proposals were used and often right: the text repeats itself
    assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens // 3 > 0
    assert e.step_count < sum(map(len, plain_greedy.values())) / 2
    proposer = e.speculation.proposer
    assert not getattr(proposer, "_index", None) and not getattr(proposer, "_requests", None)
    assert e.blocks.num_used == 0


def test_a_seeded_request_repeats_whatever_runs_beside_it():
    spec = {"method": "suffix", "num_speculative_tokens": 4}

    def sampled(rid):
        seed = 7 if rid == "x" else None  # only "x" is seeded
        return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)

    # the others' prompts and outputs resemble x's, so the global tree has much to offer
    alone = {"x": [1, 2, 3, 4, 5, 1, 2]}
    crowd = {"y": [1, 2, 3, 4, 5, 1, 2, 3], "z": [2, 3, 4, 5, 1, 2, 3, 4], **alone}
    x_plain = run(engine(), sampled, alone)["x"]
    assert run(engine(spec), sampled, alone)["x"] == x_plain
    crowded = engine(spec)
    assert run(crowded, sampled, crowd)["x"] == x_plain
    assert crowded.stats().spec_num_accepted_tokens > 0  # proposals were made and kept
