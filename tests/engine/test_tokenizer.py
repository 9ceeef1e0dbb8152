import json
import os
import shutil

import pytest

from msinfer.config import ModelConfig, eos_token_ids
from msinfer.engine.tokenizer import IncrementalDecoder, Tokenizer, find_stop
from msinfer.errors import MsinferError
from msinfer.tools.tiny_model import chat_template

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def model_dir(small_checkpoint):
    return small_checkpoint  # conftest's: read only (copy_dir before changing it)


@pytest.fixture
def copy_dir(model_dir, tmp_path):
    path = str(tmp_path / "copy")
    shutil.copytree(model_dir, path)
    return path


def rewrite_json(path, **changes):
    with open(path) as f:
        value = json.load(f)
    for key, new in changes.items():
        if new is None:
            value.pop(key, None)
        else:
            value[key] = new
    with open(path, "w") as f:
        json.dump(value, f)


def test_text_round_trips_through_ids_including_non_ascii(model_dir):
    tok = Tokenizer.from_model_dir(model_dir)
    text = "The cat sees 42 apples!\nnaïve 東京 🙂"
    ids = tok.encode(text)
    assert all(0 <= i < ModelConfig.from_model_dir(model_dir).vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_encode_as_one_id_and_decode_skips_them_by_default(model_dir):
    tok = Tokenizer.from_model_dir(model_dir)
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_eos_ids_come_from_generation_config_first(model_dir):
    tok = Tokenizer.from_model_dir(model_dir)
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))


def test_eos_ids_fall_back_to_config_json_then_to_the_tokens(copy_dir):
    os.remove(os.path.join(copy_dir, "generation_config.json"))
    tok = Tokenizer.from_model_dir(copy_dir)
    assert tok.eos_token_ids == (tok.token_to_id("<|endoftext|>"),)  # config.json's int
    rewrite_json(os.path.join(copy_dir, "config.json"), eos_token_id=None)
    tok = Tokenizer.from_model_dir(copy_dir)
    assert tok.eos_token_ids == (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>"))


def test_bad_eos_id_is_refused_naming_file_and_value(copy_dir):
    rewrite_json(os.path.join(copy_dir, "generation_config.json"), eos_token_id=["x"])
    with pytest.raises(MsinferError, match=r"generation_config.json: eos_token_id .*\['x'\]"):
        Tokenizer.from_model_dir(copy_dir)


def test_eos_ids_are_the_same_without_a_tokenizer(copy_dir):
    """One source: a checkpoint without tokenizer.json stops on the same ids."""
    with_tokenizer = Tokenizer.from_model_dir(copy_dir).eos_token_ids
    os.remove(os.path.join(copy_dir, "tokenizer.json"))
    assert eos_token_ids(copy_dir) == with_tokenizer
    os.remove(os.path.join(copy_dir, "generation_config.json"))
    end_of_text = with_tokenizer[1]
    assert eos_token_ids(copy_dir) == (end_of_text,)  # config.json's


def test_chat_template_is_qwen25_instructs_with_its_default_system_prompt(model_dir):
    tok = Tokenizer.from_model_dir(model_dir)
    assert tok.chat_template == chat_template("qwen2")
    assert tok.apply_chat_template(MESSAGES) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nWhy is the sky blue?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith(
        "assistant\n")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city, today",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "b", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "snow"},
]
MULTI_TURN = [{"role": "system", "content": "Be brief."}] + MESSAGES + [
    {"role": "assistant", "content": "Rayleigh scattering."},
    {"role": "user", "content": "And at sunset?"}]
THINKING_HISTORY = MESSAGES + [
    {"role": "assistant", "content": "<think>\nlight and air\n</think>\n\nScattering."},
    {"role": "user", "content": "More?"},
    {"role": "assistant", "content": "Shorter waves scatter more.",
     "reasoning_content": "blue is short"},
    {"role": "user", "content": "Thanks."}]
# (family, messages, tools, template kwargs): system prompt or none, multi-turn, tools with
# calls and their answers, Qwen3's thinking on and off and its history of thoughts.
CHATS = [
    ("qwen2", MESSAGES, None, {}),
    ("qwen2", MULTI_TURN, None, {}),
    ("qwen2", TOOL_TURNS, TOOLS, {}),
    ("qwen2", [{"role": "system", "content": "Use tools."}] + TOOL_TURNS, TOOLS, {}),
    ("qwen3", MESSAGES, None, {}),
    ("qwen3", MULTI_TURN, None, {"enable_thinking": True}),
    ("qwen3", MULTI_TURN, None, {"enable_thinking": False}),
    ("qwen3", THINKING_HISTORY, None, {}),
    ("qwen3", TOOL_TURNS, TOOLS, {"enable_thinking": False}),
    ("qwen3", [{"role": "system", "content": "Use tools."}] + TOOL_TURNS, TOOLS, {}),
]


@pytest.fixture(scope="module")
def qwen3_dir(tiny_checkpoint):
    return tiny_checkpoint(family="qwen3", layers=1, hidden=32, heads=2, kv_heads=1,
                           vocab=512)[0]


@pytest.mark.parametrize("family,messages,tools,kwargs", CHATS)
def test_chat_templates_render_and_encode_as_transformers_does(
        model_dir, qwen3_dir, family, messages, tools, kwargs):
    """The tiny checkpoints carry Qwen2.5-Instruct's and Qwen3's real templates: msinfer's
    rendering of them is transformers' string, and encodes to its ids."""
    transformers = pytest.importorskip("transformers")
    path = qwen3_dir if family == "qwen3" else model_dir
    hf = transformers.AutoTokenizer.from_pretrained(path)
    tok = Tokenizer.from_model_dir(path)
    assert tok.chat_template == chat_template(family)
    for generation_prompt in (True, False):
        text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                       tools=tools, **kwargs)
        assert text == hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt,
            **kwargs)
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    if tools:
        assert "<tools>" in text and '{"name": "get_weather", "arguments": ' in text
    if kwargs.get("enable_thinking") is False:
        assert tok.apply_chat_template(messages, tools=tools, **kwargs).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_think_and_tool_tags_are_one_token_each_and_decode_back(qwen3_dir):
    """As in Qwen3's vocabulary: added tokens, not special, so decoding keeps them."""
    tok = Tokenizer.from_model_dir(qwen3_dir)
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        ids = tok.encode(tag)
        assert len(ids) == 1 and tok.decode(ids) == tag


def test_template_sees_special_tokens_and_trims_blocks_like_transformers(copy_dir):
    template = ("{{ bos_token or '' }}{{ eos_token }}\n"
                "  {% for m in messages %}\n{{ m['content'] }}|{% endfor %}\n"
                "{{ messages | tojson }}")
    rewrite_json(os.path.join(copy_dir, "tokenizer_config.json"), chat_template=template)
    tok = Tokenizer.from_model_dir(copy_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '<|endoftext|>\né|[{"role": "user", "content": "é"}]')


def test_raise_exception_in_template_becomes_msinfer_error(copy_dir):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles!') }}{% endif %}"
    rewrite_json(os.path.join(copy_dir, "tokenizer_config.json"), chat_template=template)
    tok = Tokenizer.from_model_dir(copy_dir)
    with pytest.raises(MsinferError, match="refused the messages: roles!"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_cannot_modify_its_inputs(copy_dir):
    template = "{{ messages.append(1) }}"
    rewrite_json(os.path.join(copy_dir, "tokenizer_config.json"), chat_template=template)
    with pytest.raises(MsinferError, match="refused"):
        Tokenizer.from_model_dir(copy_dir).apply_chat_template(list(MESSAGES))


def test_chat_template_jinja_file_wins_over_tokenizer_config(copy_dir):
    with open(os.path.join(copy_dir, "chat_template.jinja"), "w") as f:
        f.write("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_model_dir(copy_dir).apply_chat_template(MESSAGES) == (
        "Why is the sky blue?!")


def test_no_chat_template_is_a_clear_error(copy_dir):
    os.remove(os.path.join(copy_dir, "tokenizer_config.json"))
    tok = Tokenizer.from_model_dir(copy_dir)
    assert tok.chat_template is None
    with pytest.raises(MsinferError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json_says_token_id_prompts_still_work(copy_dir):
    os.remove(os.path.join(copy_dir, "tokenizer.json"))
    path = os.path.join(copy_dir, "tokenizer.json")
    with pytest.raises(MsinferError, match=f"{path}: not found.*token ids work without one"):
        Tokenizer.from_model_dir(copy_dir)


def test_corrupt_files_are_refused_naming_the_file(copy_dir):
    with open(os.path.join(copy_dir, "tokenizer_config.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(MsinferError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_model_dir(copy_dir)
    with open(os.path.join(copy_dir, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0"}')
    with pytest.raises(MsinferError, match="tokenizer.json: not a valid tokenizer file"):
        Tokenizer.from_model_dir(copy_dir)


def test_incremental_decoding_streams_whole_characters_only(model_dir):
    tok = Tokenizer.from_model_dir(model_dir)
    text = "Tokyo is 東京 🙂, and the cat sees it."
    ids = tok.encode(text) + [tok.token_to_id("<|im_end|>")]
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == decoder.text == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # the emoji's bytes span several tokens and wait for each other


def test_find_stop_gives_the_earliest_start():
    assert find_stop("one two. three\n\nfour", ("\n\n", ".")) == 7
    assert find_stop("abcabc", ("bc", "abc")) == 0
    assert find_stop("no stops here", ("STOP",)) is None
    assert find_stop("anything", ()) is None


def test_token_bytes_are_the_utf8_bytes_even_inside_a_character(model_dir):
    """Chat logprobs' `bytes`: a byte-level token that ends inside a character (its text
    U+FFFD) still has its own bytes; joined they are the text's UTF-8, as Python encodes it."""
    tok = Tokenizer.from_model_dir(model_dir)
    text = "naïve 東京 🙂 → ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some token splits a character
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    eos = tok.eos_token_ids[0]
    assert tok.token_bytes(eos) == tok.decode([eos], skip_special_tokens=False).encode()
