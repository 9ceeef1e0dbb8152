"""Text <-> token ids for a Hugging Face model directory, and chat templates.

Wraps the `tokenizers` library's tokenizer.json (what transformers' fast tokenizers run), and
renders chat templates the way transformers does (sandboxed jinja2, trim_blocks,
lstrip_blocks, `raise_exception`, the special tokens as variables), so a chat prompt here is
the same string, and the same ids, as there.
"""
from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from ..config import eos_token_ids, read_json_object
from ..errors import MsinferError
from .text import GrowingText

# The special tokens transformers hands a chat template as variables.
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                    "cls_token", "mask_token")
# Qwen2's end-of-text and end-of-turn tokens: the fallback stop tokens when no config names any.
_FALLBACK_EOS = ("<|endoftext|>", "<|im_end|>")


def _byte_of_char():
    """GPT-2's byte-level alphabet: the character each byte is written as, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_of_char()


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: tuple[int, ...],
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None,
                 source: str = "<memory>"):
        self._tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # e.g. {"eos_token": "<|endoftext|>"}
        self.source = source
        self._compiled_template = None

    @classmethod
    def from_model_dir(cls, model_dir: str) -> Tokenizer:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise MsinferError(
                f"{path}: not found; text prompts need a tokenizer.json "
                f"(prompts given as token ids work without one)")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise MsinferError(f"{path}: not a valid tokenizer file: {e}") from None

        tokenizer_config = read_json_object(os.path.join(model_dir, "tokenizer_config.json"))
        special_tokens = {}
        for key in _TEMPLATE_TOKENS:
            token = _token_content(tokenizer_config.get(key))
            if token is not None:
                special_tokens[key] = token

        eos_ids = eos_token_ids(model_dir) or tuple(
            i for i in map(tokenizer.token_to_id, _FALLBACK_EOS) if i is not None)
        return cls(tokenizer, eos_ids,
                   chat_template=_chat_template(model_dir, tokenizer_config),
                   special_tokens=special_tokens, source=model_dir)

    def to_json_str(self) -> str:
        """The tokenizer.json text (what a grammar engine reads the token strings from)."""
        return self._tokenizer.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        # The post-processor decides about special tokens (Qwen2's adds none).
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, also when they end inside a UTF-8 character (its
        text then ends in U+FFFD): a byte-level BPE token's characters map back to bytes
        (GPT-2's table), a byte-fallback token <0xAB> is that byte."""
        token = self._tokenizer.id_to_token(int(token_id))
        if token is None:
            return b""
        special = token_id in self._tokenizer.get_added_tokens_decoder()
        if not special and type(self._tokenizer.decoder).__name__ == "ByteLevel" and all(
                c in _BYTE_OF_CHAR for c in token):
            return bytes(_BYTE_OF_CHAR[c] for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> str:
        """The prompt string for a list of {"role": ..., "content": ...} messages;
        `template_kwargs` are more variables for the template (Qwen3's enable_thinking)."""
        if self.chat_template is None:
            raise MsinferError(
                f"{self.source}: this model has no chat template (tokenizer_config.json has no "
                f"chat_template); give a plain text prompt instead")
        if self._compiled_template is None:
            try:
                self._compiled_template = _jinja_environment().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise MsinferError(f"{self.source}: chat_template does not parse: {e}") from None
        try:
            variables = dict(tools=None, documents=None,
                             add_generation_prompt=add_generation_prompt, **self.special_tokens)
            variables.update(template_kwargs)
            return self._compiled_template.render(variables, messages=messages)
        except jinja2.TemplateError as e:
            raise MsinferError(
                f"chat template of {self.source} refused the messages: {e}") from None


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8.

    Byte-level tokens can end inside a multi-byte character; decoding those alone gives U+FFFD.
    Each step decodes a short window ending at the new token, and emits only once the window
    decodes cleanly (the window's start keeps context for tokenizers that strip leading spaces).
    """

    def __init__(self, tokenizer, skip_special_tokens=True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids = []
        self.pieces = GrowingText()  # the text, in the pieces emitted (no copy per piece)
        self._prefix_start = 0  # window start: ids already emitted, kept for context
        self._emitted_end = 0  # ids up to here are in self.pieces

    def push(self, token_id):
        """Adds one id; returns the text it completes ('' while a character is unfinished)."""
        self.ids.append(int(token_id))
        prefix = self._tokenizer.decode(self.ids[self._prefix_start:self._emitted_end],
                                        skip_special_tokens=self._skip)
        window = self._tokenizer.decode(self.ids[self._prefix_start:],
                                        skip_special_tokens=self._skip)
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""
        piece = window[len(prefix):]
        self._prefix_start, self._emitted_end = self._emitted_end, len(self.ids)
        self.pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """The text so far (joined once per length)."""
        return str(self.pieces)


def prompt_list(prompt) -> list:
    """One prompt (a string or a list of token ids) or a list of them, as a list of prompts."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def encode_prompts(prompts, encode) -> list:
    """(text or None, token ids) of each prompt of `prompt_list(prompts)`: a text is encoded
    with `encode` (an empty one is no tokens), token ids are taken as they are."""
    return [(p, encode(p) if p else []) if isinstance(p, str) else (None, [int(t) for t in p])
            for p in prompt_list(prompts)]


def find_stop(text, stop_strings):
    """Index in `text` where the earliest of `stop_strings` starts, or None."""
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found) if found else None


def _jinja_environment():
    # Mirrors transformers' _compile_jinja_template: chat templates come from the Hub and are
    # untrusted, hence the immutable sandbox; its tojson does not HTML-escape.
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _token_content(value):
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(model_dir, tokenizer_config):
    # transformers >= 4.43 may save the template beside the config, and prefers that file.
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise MsinferError(
            f"{os.path.join(model_dir, 'tokenizer_config.json')}: chat_template must be a "
            f"string, got {type(template).__name__}")
    return template
