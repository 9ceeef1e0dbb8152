import json
import os
import shutil

import pytest

from msinfer.config import ModelConfig, eos_token_ids
from msinfer.engine.tokenizer import IncrementalDecoder, Tokenizer, find_stop
from msinfer.errors import MsinferError
from msinfer.tools.tiny_model import CHAT_TEMPLATE

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


def test_chat_template_renders_chatml_with_generation_prompt(model_dir):
    tok = Tokenizer.from_model_dir(model_dir)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(MESSAGES) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith(
        "assistant\n")


def test_chat_template_matches_transformers(model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok = Tokenizer.from_model_dir(model_dir)
    messages = [{"role": "system", "content": "Be brief."}] + MESSAGES + [
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": "And at sunset?"}]
    text = tok.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]


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
