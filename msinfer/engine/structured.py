"""Structured output: a JSON schema, any JSON object, a regex, a choice of strings or a Lark
grammar, enforced while decoding by llguidance (a maintained grammar engine, on the host).

A request names its constraint in `SamplingParams.structured_outputs`, one key of vLLM's
StructuredOutputsParams: {"json": schema}, {"json_object": True}, {"regex": "..."},
{"choice": ["a", "b"]} or {"grammar": "lark or GBNF text"}, with "after_think": True to let a
thinking model write <think>...</think> first (the server sets it with a reasoning parser).
Where sampling happens (the only rank that samples, in a tensor group), each such sequence
holds a `GuidedSequence`: before a row is sampled its logits outside the grammar's token mask
become -inf; the sampled token then advances the matcher; once the grammar admits nothing but
the end, the sequence stops.

Why llguidance and not xgrammar (measured by bench/structured.py: bench/README.md,
"Structured output"): a schema compiles lazily in about a millisecond where xgrammar's
compile of a new schema takes seconds, which would stall every running request's step; its
per-token masks cost more than xgrammar's but little beside a step; and llguidance needs no
torch, triton or transformers.
JSON is compact by default (no free whitespace, which a weak model could emit forever); a
schema's own "x-guidance" options override that.
"""
from __future__ import annotations

import json

import numpy as np

from ..errors import MsinferError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# msinfer's option beside the kind: a thinking model (Qwen3) may first think in
# <think>...</think>, unconstrained, as vLLM lets it with a reasoning parser
AFTER_THINK = "after_think"


def marker(text, token_id=None):
    """A tag in Lark: the tokenizer's own token for it when it has one (`<[id]>`: llguidance
    reads a tokenizer's added tokens as special, so the quoted text would never match Qwen's
    single <think> or <tool_call> token), else the text."""
    token = token_id(text) if token_id is not None else None
    return f"<[{token}]>" if token is not None else json.dumps(text)


def _think_first(token_id):
    """Lark: an optional thought, whitespace, then the constraint (`@constraint`)."""
    start, end = marker("<think>", token_id), marker("</think>", token_id)
    if start.startswith("<["):  # tokens: the thought is any text between them
        think = f"think: {start} THOUGHT {end}\nTHOUGHT: /(?s:.*)/\n"
    else:  # text: the thought ends at the first </think>
        think = f"think[lazy]: {start} /(?s:.*)/ {end}\n"
    return f"start: think? ws @constraint\n{think}ws: /[ \\t\\n]*/\n"
# llguidance's JSON options: "," and ":" separators, no free whitespace (a schema's
# "x-guidance" overrides these, as llguidance reads it)
_JSON_DEFAULTS = {"whitespace_flexible": False}


def _llguidance():
    import llguidance  # imported where used: followers never build a grammar
    return llguidance


def refuse(field, why):
    """An MsinferError naming the request field at fault (HTTP 400's `param`)."""
    error = MsinferError(f"{field}: {why}")
    error.field = field
    return error


def check_spec(spec, field="structured_outputs"):
    """The (kind, value) of a structured_outputs dict: exactly one known key, of the right
    type. Refuses anything else with an MsinferError naming `field`."""
    if not isinstance(spec, dict):
        raise refuse(field, f"must be an object with one of {', '.join(KINDS)}")
    if spec.get(AFTER_THINK) not in (None, False, True):
        raise refuse(field, f"{AFTER_THINK} must be true or false")
    given = {k: v for k, v in spec.items()
             if v is not None and v is not False and k != AFTER_THINK}
    unknown = [k for k in given if k not in KINDS]
    if unknown:
        raise refuse(field, f"unknown key {unknown[0]!r}; use one of {', '.join(KINDS)}")
    if len(given) != 1:
        raise refuse(field, f"give exactly one of {', '.join(KINDS)}, got "
                            f"{sorted(given) or 'none'}")
    kind, value = next(iter(given.items()))
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise refuse(field, f"json: the schema is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise refuse(field, "json: a JSON schema is an object (or true/false)")
    elif kind == "json_object":
        if value is not True:
            raise refuse(field, "json_object must be true")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise refuse(field, f"{kind} must be a non-empty string")
    elif kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise refuse(field, "choice must be a non-empty list of non-empty strings")
        value = list(value)
    return kind, value


def normalized(spec, field="structured_outputs"):
    """The spec as SamplingParams keeps it: {kind: value}, and the option when set."""
    kind, value = check_spec(spec, field)
    return {kind: value, **({AFTER_THINK: True} if spec.get(AFTER_THINK) else {})}


def grammar_of(spec, field="structured_outputs", token_id=None):
    """llguidance's grammar text for a structured_outputs dict; refuses (naming `field`) a
    spec or a schema or grammar the engine cannot compile. token_id: the tokenizer's
    token_to_id, for tags that are tokens of their own."""
    kind, value = check_spec(spec, field)
    grammar = _grammar(kind, value, field)
    if spec.get(AFTER_THINK):
        # the constraint as a sub-grammar, after an optional thought
        inner = _grammar_list(grammar)
        inner[0]["name"] = "constraint"
        grammar = json.dumps({"grammars": [{"name": "think_first",
                                            "lark_grammar": _think_first(token_id)}] + inner})
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise refuse(field, f"the grammar engine cannot compile this {kind}: "
                            f"{_first_line(messages[0])}")
    return grammar


def _grammar_list(grammar):
    """llguidance's grammars of a grammar text: JSON {"grammars": [...]}, or Lark as is."""
    try:
        return json.loads(grammar)["grammars"]
    except (ValueError, KeyError, TypeError):
        return [{"lark_grammar": grammar}]


def _grammar(kind, value, field):
    lg = _llguidance()
    matcher = lg.LLMatcher
    try:
        if kind == "json":
            grammar = matcher.grammar_from_json_schema(value, defaults=_JSON_DEFAULTS)
        elif kind == "json_object":
            grammar = matcher.grammar_from_json_schema({"type": "object"},
                                                       defaults=_JSON_DEFAULTS)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(value)
        elif kind == "choice":
            grammar = lg.grammar_from("choice", value)
        else:
            grammar = lg.grammar_from("grammar", value)
    except (ValueError, TypeError) as e:
        raise refuse(field, f"{kind}: {e}") from None
    return grammar


def _first_line(message):
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


class GrammarEngine:
    """llguidance's view of one tokenizer and model: its token strings over the model's rows
    (a model may have more rows than its tokenizer has tokens: those rows are never allowed)
    and its end tokens. Built once, when the first guided request is sampled."""

    def __init__(self, tokenizer, vocab_size, eos_token_ids):
        lg = _llguidance()
        eos = sorted(eos_token_ids)
        if not eos:
            raise MsinferError("structured output needs an end-of-sequence token: the model "
                               "names none (generation_config.json eos_token_id)")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos)
        self.token_id = tokenizer.token_to_id
        self.tokenizer = lg.LLTokenizer(tokenizer.to_json_str(), n_vocab=vocab_size,
                                        eos_token=eos)

    def start(self, spec):
        return GuidedSequence(self, grammar_of(spec, token_id=self.token_id))


class GuidedSequence:
    """One sequence's matcher and the mask of its next token."""

    def __init__(self, engine, grammar):
        lg = _llguidance()
        self.engine = engine
        self.matcher = lg.LLMatcher(engine.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise refuse("structured_outputs", _first_line(self.matcher.get_error()))
        self._words = np.empty((engine.vocab_size + 31) // 32, dtype=np.int32)
        self.allowed = None  # bool per model row, for the next token
        self._compute_mask()

    def _compute_mask(self):
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        self.allowed = bits[:self.engine.vocab_size].astype(bool)

    def mask(self, row):
        """`row` (the logits of this sequence, changed in place) with every token the grammar
        does not allow next set to -inf."""
        row[~self.allowed] = -np.inf

    def advance(self, token):
        """Take the sampled `token`; returns False if the grammar refused it (an error)."""
        if not self.matcher.consume_token(int(token)):
            return False
        if not self.matcher.is_stopped():
            self._compute_mask()
        return True

    def advance_all(self, tokens):
        """Take tokens generated before this state existed (none, unless a follower became
        the sampler)."""
        for token in tokens:
            if not self.advance(token):
                raise MsinferError(f"the grammar refused generated token {token}: {self.error}")

    @property
    def error(self):
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def complete(self):
        """The grammar admits nothing more but the end: the sequence stops here."""
        if self.matcher.is_stopped():
            return True
        allowed = np.flatnonzero(self.allowed)
        return all(int(t) in self.engine.eos_token_ids for t in allowed[:len(
            self.engine.eos_token_ids) + 1])
