"""The engine's step on the host, without a model: a stub runner's logits pick the next token
(the last one + 1), a stub tokenizer spells token t as one letter. What a step costs must
not grow with the sequence: no list copied per step, stop strings searched in the new text
only; and the digest the ranks of a tensor group compare covers the tokens they hold."""
import tracemalloc

import numpy as np
import pytest

from msinfer.engine import LLMEngine
from msinfer.engine import sequence as sequence_module
from msinfer.engine.block_manager import BlockManager
from msinfer.engine.sampling import SamplingParams
from msinfer.engine.scheduler import Scheduler
from msinfer.engine.sequence import Sequence
from msinfer.engine_config import EngineLimits
from msinfer.planning.kv_layout import CacheLayout

from fake_engine import stub_engine_config

VOCAB = 64
MAX_LEN = 4096


class StubRunner:
    """Logits whose argmax is the next token: (token at the position + 1) % VOCAB."""

    def _rows(self, tokens):
        logits = np.zeros((len(tokens), VOCAB), np.float32)
        logits[np.arange(len(tokens)), (np.asarray(tokens, np.int64) + 1) % VOCAB] = 5.0
        return logits

    def decode(self, seqs):
        return self._rows([s.last_token for s in seqs])

    def prefill(self, chunks):
        return self._rows([c.seq.token_slice(p, p + 1)[0] for c in chunks
                           for p in c.logit_positions()])


class LetterTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def engine():
    layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=4, block_size=16,
                         num_blocks=2 * MAX_LEN // 16 + 2, dtype_bytes=4)
    limits = EngineLimits(max_model_len=MAX_LEN, max_num_seqs=4, max_prefill_tokens=64)
    return LLMEngine(StubRunner(), layout, stub_engine_config(limits, VOCAB),
                     eos_token_ids=[VOCAB + 1], seed=0, tokenizer=LetterTokenizer)


def test_the_stub_engine_generates_the_next_letters_and_stops_at_a_stop_string():
    e = engine()
    e.add_request("a", [0, 1, 2], SamplingParams(max_tokens=40, temperature=0, stop=["ghi"],
                                                 logprobs=1))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    final = outs[-1]
    assert final.token_ids == list(range(3, 9)) and final.finish_reason == "stop"
    assert final.text == "def"  # cut before the stop string "ghi"
    assert len(final.logprobs) == 6 and all(3 + i in lp for i, lp in enumerate(final.logprobs))
    # each output is what the sequence held when it was made, not what it holds later
    assert [len(o.token_ids) for o in outs] == list(range(1, 7))
    assert outs[0].token_ids == [3] and outs[0].logprobs[0].keys() == {3}


def test_a_prompts_last_token_left_to_a_decode_step_counts_as_prefilled():
    """A 65-token prompt in chunks of 64: its last token goes to the decode call, and is
    counted with the prompt's other prefilled tokens (msinfer_prefill_tokens_computed: it was
    not, and a served job's count came out one token short)."""
    e = engine()
    e.add_request("a", [i % VOCAB for i in range(65)], SamplingParams(max_tokens=3, temperature=0))
    while e.has_unfinished_requests():
        e.step()
    assert e.prefill_tokens_computed == 65


def test_stop_strings_are_searched_in_the_new_text_only(monkeypatch):
    searched = []
    real = sequence_module.find_stop
    monkeypatch.setattr(sequence_module, "find_stop",
                        lambda text, stops: searched.append(len(text)) or real(text, stops))
    e = engine()
    tokens = 2000
    e.add_request("a", [0], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                           stop=["never here", "XYZ"]))
    while e.has_unfinished_requests():
        e.step()
    longest = len("never here")
    # each step searches its new letter and the 9 before it; a rescan would be ~2,000,000
    assert sum(searched) <= tokens * longest, sum(searched)


def test_a_steps_memory_does_not_grow_with_the_sequence():
    """tracemalloc's peak within one step, at 200 and at 2,200 tokens: copies of the token
    and logprob lists would add 8 bytes a token each (32 KB)."""
    e = engine()
    e.add_request("a", [0], SamplingParams(max_tokens=2400, temperature=0, ignore_eos=True,
                                           logprobs=1, stop=["XYZ"]))
    peaks = {}
    tracemalloc.start()
    try:
        for step in range(1, 2201):
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            outs = e.step()
            peaks[step] = tracemalloc.get_traced_memory()[1] - before
            del outs
    finally:
        tracemalloc.stop()
    early = min(peaks[s] for s in range(190, 210))
    late = min(peaks[s] for s in range(2190, 2201))
    assert late - early < 4 * 2000, (early, late)


def test_a_steps_text_work_does_not_grow_with_the_answer(monkeypatch):
    """The text's share of a step (the decoder's new piece, the stop-string search, the
    output's text: `Sequence.stop_reason` and `LLMEngine._output`) allocates at its peak as
    much at 2,000 tokens as at 300 (medians of 100 steps). A text grown by `+=` is copied
    whole at each token while an output holds it: 2 KB more at the end, one letter a token.
    Running outputs see the text so far; a finished one holds it as a str."""
    costs = []

    def measured(method):
        def run(*args):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            result = method(*args)
            costs[-1] += tracemalloc.get_traced_memory()[1] - before
            return result
        return run

    monkeypatch.setattr(Sequence, "stop_reason", measured(Sequence.stop_reason))
    monkeypatch.setattr(LLMEngine, "_output", measured(LLMEngine._output))
    e, tokens = engine(), 2000
    e.add_request("a", [0], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                           stop=["XYZ"]))
    outs = []
    tracemalloc.start()
    try:
        while e.has_unfinished_requests():
            costs.append(0)
            outs += e.step()
    finally:
        tracemalloc.stop()
    letters = "".join(chr(ord("a") + (1 + i) % VOCAB % 26) for i in range(tokens))
    assert len(outs) == tokens and type(outs[-1].text) is str and outs[-1].text == letters
    assert [str(outs[i].text) for i in (0, 99, 1998)] == [letters[:1], letters[:100],
                                                          letters[:1999]]
    assert outs[99].text[95:] == letters[95:100] and len(outs[99].text) == 100
    # from step 300 on: the positions' ints are objects of their own (CPython caches 0-256)
    early, late = np.median(costs[300:400]), np.median(costs[-100:])
    assert late <= early + 128, (early, late)


def test_token_slice_reads_across_prompt_and_generated():
    s = Sequence("a", [1, 2, 3], SamplingParams())
    s.generated += [4, 5]
    assert s.token_slice(0, 5) == [1, 2, 3, 4, 5] == s.tokens
    assert s.token_slice(2, 4) == [3, 4] and s.token_slice(3, 5) == [4, 5]
    assert s.last_token == 5


def test_the_schedule_digest_covers_the_tokens_each_rank_holds():
    """Two ranks that hold the same sequences at the same positions in the same blocks, but
    one took another token for one of them: their digests differ before the step runs."""
    def rank(last):
        layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=4, block_size=4,
                             num_blocks=16, dtype_bytes=4)
        scheduler = Scheduler(BlockManager(layout),
                              EngineLimits(max_num_seqs=4, max_prefill_tokens=64))
        seqs = [Sequence(n, [1, 2, 3, 4, 5], SamplingParams()) for n in "ab"]
        for s in seqs:
            scheduler.add(s)
        for chunk in scheduler.schedule().chunks:
            chunk.seq.computed += chunk.count
            chunk.seq.append_token(7)
        seqs[1].append_token(last)  # what the leader decided, as this rank applied it
        seqs[1].computed += 1
        seqs[0].append_token(9)
        seqs[0].computed += 1
        return scheduler.schedule()

    assert rank(8).digest() == rank(8).digest()
    assert rank(8).digest() != rank(6).digest()
