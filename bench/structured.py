"""The grammar engine behind structured output (msinfer/engine/structured.py), on a vocabulary
of Qwen's size: llguidance beside xgrammar, and what guiding costs a step.

    python bench/structured.py          # ~1 minute; xgrammar is measured if it is installed
                                        # (pip install xgrammar==0.2.8: it pulls torch, triton)

The tokenizer is byte-level BPE with 151,643 tokens of random text over JSON's characters and
Qwen2's 3 special tokens, the model 151,936 rows (the 293 rows past the tokenizer are padding,
as in Qwen2): what the engines read of a tokenizer is its token strings. Per engine: building
its view of the tokenizer (once per process), compiling a JSON schema (once per request), and
the next-token mask along a 48-token document (once per token). Then msinfer's own per-row
work in a step: mask computed and unpacked, row masked, completion checked.
"""
import json
import random
import statistics
import sys
import time

import numpy as np

N_VOCAB = 151936
TOKENIZER_SIZE = 151643
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
DOCUMENT = '{"name":"ab cd","age":42,"tags":["a","b"]}'  # compact, as msinfer asks


def byte_level_tokenizer_json(seed=0):
    """tokenizer.json of a byte-level BPE with TOKENIZER_SIZE tokens and 3 special ones."""
    rng = random.Random(seed)
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes, extra = printable[:], 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    to_char = {b: chr(c) for b, c in zip(printable, codes)}
    alphabet = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "{}[]:,._-\n'
    words = set()
    while len(words) < TOKENIZER_SIZE - 256:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        words.add("".join(to_char[b] for b in word.encode()))
    vocab = {to_char[b]: b for b in range(256)}
    for word in sorted(words):
        vocab[word] = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = [{"id": len(vocab) + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, s in enumerate(specials)]
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": True}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": level, "post_processor": None, "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []}}), len(vocab) + 2  # (json, <|im_end|>)


def ms(seconds):
    return f"{seconds * 1e3:.3f} ms"


def bench_llguidance(tokenizer_json, eos, ids):
    import llguidance
    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=N_VOCAB, eos_token=eos)
    built = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compiled = time.perf_counter() - start
    words = np.empty((N_VOCAB + 31) // 32, np.int32)
    masks = []
    for token in ids:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        masks.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    return built, compiled, masks


def bench_xgrammar(tokenizer_json, eos, ids):
    import xgrammar
    vocab = json.loads(tokenizer_json)
    strings = sorted(list(vocab["model"]["vocab"].items())
                     + [(t["content"], t["id"]) for t in vocab["added_tokens"]],
                     key=lambda kv: kv[1])
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_vocab_and_metadata(
        [s for s, _ in strings], json.dumps({"vocab_type": 2, "vocab_size": N_VOCAB,
                                             "add_prefix_space": False,
                                             "stop_token_ids": [eos]}))
    compiler = xgrammar.GrammarCompiler(info)
    built = time.perf_counter() - start
    start = time.perf_counter()
    compiled_grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                    separators=(",", ":"))
    compiled = time.perf_counter() - start
    matcher = xgrammar.GrammarMatcher(compiled_grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, N_VOCAB)
    masks = []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - start)
        assert matcher.accept_token(token), token
    return built, compiled, masks


def bench_msinfer_row(tokenizer_json, eos, ids):
    """msinfer's per-row work in a step (GuidedSequence): advance + mask + complete."""
    from msinfer.engine.structured import GrammarEngine

    class Source:
        def to_json_str(self):
            return tokenizer_json
    engine = GrammarEngine(Source(), N_VOCAB, {eos})
    guided = engine.start({"json": SCHEMA})
    row = np.random.default_rng(0).standard_normal(N_VOCAB).astype(np.float32)
    times = []
    for token in ids:
        start = time.perf_counter()
        work = row.copy()  # a fresh logits row, as each step's is
        guided.mask(work)
        assert np.isfinite(work[token])
        guided.advance(token)
        guided.complete
        times.append(time.perf_counter() - start)
    return times


def main():
    import tokenizers
    tokenizer_json, eos = byte_level_tokenizer_json()
    ids = tokenizers.Tokenizer.from_str(tokenizer_json).encode(DOCUMENT).ids
    print(f"vocabulary {N_VOCAB} rows ({TOKENIZER_SIZE + 3} tokens), document of {len(ids)} "
          f"tokens")
    for name, run in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            built, compiled, masks = run(tokenizer_json, eos, ids)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        print(f"{name}: tokenizer view {ms(built)} (once), schema compile {ms(compiled)} "
              f"(per request), mask per token median {ms(statistics.median(masks))}, "
              f"max {ms(max(masks))}")
    times = bench_msinfer_row(tokenizer_json, eos, ids)
    print(f"msinfer per guided row and step (row copy, mask, advance, completion check): "
          f"median {ms(statistics.median(times))}, max {ms(max(times))}")


if __name__ == "__main__":
    sys.exit(main())
