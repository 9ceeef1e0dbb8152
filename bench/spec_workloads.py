"""Prompt sets for the speculative decoding bench (issue 39), as token ids, for a copying
checkpoint (`msinfer make-tiny-model DIR --copying`, msinfer/tools/copying_model.py) and for
plain random ones alike; deterministic for a seed.

- grounded: prompts whose answers copy spans of them, the case speculation is for (code
  edits, RAG answers, summaries, extraction). A 'document' of distinct random tokens, a
  'question' of other tokens, then a cue: the first tokens of a span of the document, so
  that the answer is the rest of that span (`answers`: the document's next `max_tokens`
  tokens, what a copying model generates). n-gram proposals (match the last tokens, propose
  what followed) are accepted there on a copying model, and a draft copies as its target.
- no_repeat: prompts of distinct random tokens, as long, with nothing to copy: n-gram
  proposals find nothing in the prompt, or find a token whose continuation the model does
  not follow, and are rejected; what speculation costs when it cannot win (it should stop
  proposing, issue 39 item 5).

Both at batch 1 and batch 8 (`rounds` batches of each size: the bench sends `batch_size`
prompts at a time). Every prompt starts with the sink token (pass the tokenizer's
<|im_start|>, as chat prompts start; special_tokens() reads it): a copying model attends
there where nothing matches. Prompt tokens avoid the special tokens.

    from spec_workloads import special_tokens, spec_workloads
    specials = special_tokens(model_dir)
    for w in spec_workloads(vocab_size, specials["<|im_start|>"], avoid=specials.values()):
        ...  # w.name, w.batch_size, w.prompts, w.max_tokens, w.answers
"""
import dataclasses
import json
import os

import numpy as np

BATCH_SIZES = (1, 8)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str  # "grounded" or "no_repeat"
    batch_size: int
    prompts: list  # lists of token ids, rounds x batch_size of them
    max_tokens: int
    answers: list | None  # grounded: the tokens a copying model generates; else None


def spec_workloads(vocab_size, sink_token, *, avoid=(), batch_sizes=BATCH_SIZES, rounds=2,
                   doc_len=384, question_len=16, cue_len=4, max_tokens=64, seed=0):
    """[Workload] for each of grounded and no_repeat, at each batch size, prompts of
    1 + doc_len + question_len + cue_len tokens (the sink first)."""
    allowed = np.setdiff1d(np.arange(vocab_size), [sink_token, *avoid])
    if len(allowed) < doc_len + question_len + cue_len:
        raise ValueError(f"a vocabulary of {vocab_size} holds too few tokens for prompts of "
                         f"{doc_len + question_len + cue_len} distinct ones")
    if cue_len < 2 or doc_len < cue_len + max_tokens:
        raise ValueError(f"cue_len={cue_len} must be >= 2 (the model continues a bigram) and "
                         f"doc_len={doc_len} >= cue_len + max_tokens")
    workloads = []
    for batch_size in batch_sizes:
        rng = np.random.default_rng([seed, batch_size])
        count = rounds * batch_size
        grounded = [grounded_prompt(rng, allowed, sink_token, doc_len, question_len, cue_len,
                                    max_tokens) for _ in range(count)]
        workloads.append(Workload("grounded", batch_size, [p for p, _ in grounded], max_tokens,
                                  [a for _, a in grounded]))
        length = doc_len + question_len + cue_len
        workloads.append(Workload(
            "no_repeat", batch_size,
            [[sink_token] + rng.choice(allowed, length, replace=False).tolist()
             for _ in range(count)], max_tokens, None))
    return workloads


def grounded_prompt(rng, allowed, sink_token, doc_len, question_len, cue_len, max_tokens):
    """(prompt, answer): sink, document, question, the cue that starts a span of the document;
    the answer is the span's next max_tokens tokens."""
    tokens = rng.choice(allowed, doc_len + question_len, replace=False).tolist()
    document, question = tokens[:doc_len], tokens[doc_len:]
    start = int(rng.integers(0, doc_len - cue_len - max_tokens + 1))
    cue = document[start:start + cue_len]
    answer = document[start + cue_len:start + cue_len + max_tokens]
    return [sink_token] + document + question + cue, answer


def special_tokens(model_dir):
    """{text: id} of the tokenizer's added tokens (<|endoftext|>, <|im_start|>, ...)."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        return {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
