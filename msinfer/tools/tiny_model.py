"""Random Qwen2 and Qwen3 checkpoints in Hugging Face layout, for tests and benchmarks.

`make_tiny_model(dir)` writes what a downloaded Qwen2 (`family="qwen3"`: Qwen3 dense; with
`moe`: Qwen2-MoE or Qwen3-MoE, experts stored per expert as transformers writes them)
directory holds: config.json (4.x or 5.x spelling), safetensors weights (one file or sharded
with an index; float32, float16 or real bfloat16), generation_config.json, and a byte-level
BPE tokenizer.json with Qwen2's special tokens and the family's real chat template
(Qwen2.5-Instruct's, or Qwen3's with thinking and tools). Transformers loads it as
Qwen2ForCausalLM (Qwen3ForCausalLM). With `copying=True` the weights are not random but a
Qwen2 that copies spans of its context (copying_model.py), for speculative decoding.

Same arguments and seed, same bytes: every tensor draws from its own generator, seeded by
(seed, tensor name), so sharding or dtype do not change the values either.
"""
import itertools
import json
import os
import zlib

import numpy as np

from ..config import ModelConfig
from ..errors import MsinferError, positive_int
from . import copying_model

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's vocabulary holds these as added tokens that are not special (decoding keeps them);
# the tiny Qwen3 tokenizer has them too, so `</think>` is one token as there.
QWEN3_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                      "<think>", "</think>")
# The families' chat templates, verbatim, in chat_templates/ beside this file:
# - qwen2.5-instruct.jinja: the chat_template of Qwen/Qwen2.5-7B-Instruct's
#   tokenizer_config.json (the Qwen2.5-Instruct series share it), as the kalosm crate's
#   chat-template tests copy it verbatim (and chujiezheng/chat_templates'
#   chat_templates/qwen2.5-instruct.jinja with its whitespace changed).
# - qwen3.jinja: the chat_template of Qwen/Qwen3-0.6B (the Qwen3 dense series share it), as
#   huggingface/trl keeps it in trl/chat_templates/qwen3.jinja (commit a22ae88f).
CHAT_TEMPLATE_FILES = {"qwen2": "qwen2.5-instruct.jinja", "qwen3": "qwen3.jinja"}

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen/Qwen2-0.5B).
_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
ROPE_THETA = 1000000.0  # Qwen2's
# A copying model's: its induction head matches on rotary pairs that hardly turn over the
# context, and at 1e8 half of a 64-wide head's pairs do over 4096 positions.
COPYING_ROPE_THETA = 1e8
# The tokenizer trains at most this many tokens (its English corpus holds about 500 merges,
# and training stays a matter of milliseconds); the rest of the model's vocabulary is filled
# with tokens no merge reaches (short letter strings), so that every id decodes to text.
MAX_TOKENIZER_VOCAB = 1024
_FILLER_LETTERS = "abcdefghijklmnopqrstuvwxyz"

FAMILIES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

SHAPE_PRESETS = {
    # Qwen/Qwen2-0.5B's shape, random weights: for benchmarks (about 2 GB in float32).
    "qwen2-0.5b-shape": dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864,
                             vocab=151936, tie=True, max_position=131072),
    # Qwen/Qwen3-0.6B's shape (head_dim 128 over hidden 1024), random weights (2.4 GB float32).
    "qwen3-0.6b-shape": dict(family="qwen3", layers=28, hidden=1024, heads=16, kv_heads=8,
                             head_dim=128, intermediate=3072, vocab=151936, tie=True,
                             max_position=40960),
}

# A copying model's shape (make_tiny_model(copying=True)), the CLI's with --copying: a 2-layer
# draft; a target is the same with more layers (the same seed: the same copying circuit).
COPYING_SHAPE = dict(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=704, vocab=2048)

DTYPES = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}
MOE_ARCHITECTURES = {"qwen2": "Qwen2MoeForCausalLM", "qwen3": "Qwen3MoeForCausalLM"}
# make_tiny_model's `moe` keys, with their defaults (MoeOptions; config.json's names after)
MOE_DEFAULTS = dict(experts=8, top_k=2, moe_intermediate=None, shared_expert_intermediate=None,
                    mlp_only_layers=(), decoder_sparse_step=1, norm_topk_prob=None)


def chat_template(family="qwen2"):
    """The chat template text make_tiny_model writes for `family`."""
    path = os.path.join(os.path.dirname(__file__), "chat_templates", CHAT_TEMPLATE_FILES[family])
    with open(path, encoding="utf-8") as f:
        return f.read()


def added_tokens(family):
    """The tokens a family's tokenizer adds after training: special ones, then (Qwen3) the
    think and tool tags."""
    return SPECIAL_TOKENS + (QWEN3_ADDED_TOKENS if family == "qwen3" else ())


def default_intermediate(hidden):
    """2.75 x hidden, rounded up to a multiple of 8: near Llama's MLP ratio, and small."""
    return -(-hidden * 11 // 32) * 8


def make_tiny_model(out_dir, *, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=None,
                    vocab=512, tie=False, dtype="float32", seed=0, shards=1, config_style="4",
                    max_position=4096, family="qwen2", head_dim=None, moe=None,
                    copying=False, rope_theta=None, progress=None):
    """Writes a random Qwen2 (or Qwen3: `family="qwen3"`) checkpoint directory; returns its
    ModelConfig. `head_dim`: the attention head size, written to config.json (None: hidden /
    heads, written for Qwen3, whose configs always carry it). `moe`: a mixture-of-experts
    model of the family (Qwen2-MoE / Qwen3-MoE), a dict of MOE_DEFAULTS' keys (None: dense).
    `copying`: weights that copy spans of the context (copying_model.py; a dense Qwen2,
    untied, e.g. hidden 256, heads 4 of 64, vocab 2048), the same circuit for the same seed
    and shape whatever the layer count. `rope_theta`: None is Qwen2's 1e6
    (COPYING_ROPE_THETA with `copying`).

    `progress(done, total, name)` is called after each tensor is written.
    """
    if intermediate is None:
        intermediate = default_intermediate(hidden)
    if rope_theta is None:
        rope_theta = COPYING_ROPE_THETA if copying else ROPE_THETA
    config_style = str(config_style)
    _check_arguments(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     intermediate=intermediate, vocab=vocab, dtype=dtype, seed=seed,
                     shards=shards, config_style=config_style, max_position=max_position,
                     family=family, head_dim=head_dim, rope_theta=rope_theta)
    if copying and moe is not None:
        raise MsinferError("make-tiny-model: copying models are dense (no --moe)")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise MsinferError(f"{out_dir} is not empty; make-tiny-model writes into a new directory")

    tokenizer = train_tokenizer(vocab, family)
    end_of_text, _, end_of_turn = (tokenizer.token_to_id(t) for t in SPECIAL_TOKENS)
    config_json = model_config_dict(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
        vocab=vocab, tie=tie, dtype=dtype, max_position=max_position, config_style=config_style,
        bos_token_id=end_of_text, eos_token_id=end_of_text, family=family, head_dim=head_dim,
        rope_theta=rope_theta)
    if moe is not None:
        config_json.update(moe_config_dict(family, hidden, **moe))
    config_path = os.path.join(out_dir, "config.json")
    # The checkpoint's tensor names and shapes are the ones msinfer reads back from this config.
    config = ModelConfig.from_dict(config_json, source=config_path)
    if shards > len(config.parameter_shapes()):
        raise MsinferError(f"make-tiny-model: shards={shards} is more than the checkpoint's "
                           f"{len(config.parameter_shapes())} tensors")
    if copying:
        copying_model.check_copying_config(config)

    os.makedirs(out_dir, exist_ok=True)
    _write_json(config_path, config_json)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), _tokenizer_config(tokenizer, family))
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": end_of_text, "eos_token_id": [end_of_turn, end_of_text],
        "pad_token_id": end_of_text})
    if copying:
        sinks = [tokenizer.token_to_id(t) for t in added_tokens(family)]
        weights = copying_model.copying_weights(config, seed, sinks)
        tensor = weights.__getitem__
    else:
        def tensor(name):
            return random_tensor(name, config.parameter_shapes()[name], seed)
    _write_weights(out_dir, config.parameter_shapes(), tensor, dtype, shards, progress)
    return config


def model_config_dict(*, layers, hidden, heads, kv_heads, intermediate, vocab, tie, dtype,
                      max_position, config_style, bos_token_id, eos_token_id, family="qwen2",
                      head_dim=None, rope_theta=ROPE_THETA):
    """config.json as transformers 4.x (`rope_theta`, `torch_dtype`) or 5.x writes it."""
    config = {
        "architectures": [FAMILIES[family]],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_position,
        "max_window_layers": layers,
        "model_type": family,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "sliding_window": None,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }
    if family == "qwen3":  # Qwen3's configs name both
        config.update(head_dim=head_dim or hidden // heads, attention_bias=False)
    elif head_dim is not None:
        config["head_dim"] = head_dim
    if config_style == "4":
        config.update(rope_theta=rope_theta, torch_dtype=dtype, transformers_version="4.40.1")
    else:
        config.update(rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                      dtype=dtype, layer_types=["full_attention"] * layers,
                      transformers_version="5.0.0")
    return dict(sorted(config.items()))


def moe_config_dict(family, hidden, *, experts=8, top_k=2, moe_intermediate=None,
                    shared_expert_intermediate=None, mlp_only_layers=(), decoder_sparse_step=1,
                    norm_topk_prob=None):
    """config.json's MoE keys as the released Qwen2-57B-A14B / Qwen3-30B-A3B spell them
    (`num_experts`). Defaults: experts of half the hidden size, a shared expert (Qwen2-MoE) of
    four experts' width, norm_topk_prob true for Qwen3-MoE as released, false for Qwen2-MoE."""
    moe_intermediate = moe_intermediate or max(8, hidden // 2)
    config = {"architectures": [MOE_ARCHITECTURES[family]], "model_type": family + "_moe",
              "num_experts": experts, "num_experts_per_tok": top_k,
              "moe_intermediate_size": moe_intermediate,
              "decoder_sparse_step": decoder_sparse_step,
              "mlp_only_layers": list(mlp_only_layers),
              "norm_topk_prob": (family == "qwen3" if norm_topk_prob is None
                                 else bool(norm_topk_prob)),
              "output_router_logits": False, "router_aux_loss_coef": 0.001}
    if family == "qwen2":
        config.update(shared_expert_intermediate_size=(shared_expert_intermediate
                                                       or 4 * moe_intermediate),
                      qkv_bias=True)
    return config


def train_tokenizer(vocab_size, family="qwen2"):
    """A byte-level BPE tokenizer of `vocab_size` tokens built like Qwen2's (Qwen3's: with
    its think and tool tags), trained on generated English (at most MAX_TOKENIZER_VOCAB
    tokens), its special tokens after the trained ones, then filler tokens (`_filled`)."""
    # Imported here: `msinfer plan` (whose CLI lists this command) runs without tokenizers.
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, MAX_TOKENIZER_VOCAB) - len(added_tokens(family)),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(english_sentences(), trainer)
    # Added after training, so they take the last ids, as in Qwen2's vocabulary.
    tokenizer.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if family == "qwen3":
        tokenizer.add_tokens(
            [tokenizers.AddedToken(t, special=False, normalized=False)
             for t in QWEN3_ADDED_TOKENS])
    return _filled(tokenizer, vocab_size)


def _filled(tokenizer, size):
    """`tokenizer` grown to `size` ids: after its trained and added tokens (whose ids stay
    what they are at any size, so a model's eos ids do not depend on its vocabulary), BPE
    tokens of letter strings ("ab", "Ġab", ... "abc", ...; Ġ is byte-level BPE's space) not
    in it yet, which no merge makes (encoding is unchanged) and which decode to
    themselves."""
    import tokenizers

    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for added in data["added_tokens"]:  # in the model's vocabulary too, or a tokenizer
        vocab[added["content"]] = added["id"]  # loading this one would renumber them
    next_id = 1 + max(vocab.values())
    words = (prefix + "".join(letters) for length in range(2, 6)
             for letters in itertools.product(_FILLER_LETTERS, repeat=length)
             for prefix in ("", "\u0120"))
    for token in words:
        if next_id >= size:
            break
        if token not in vocab:
            vocab[token] = next_id
            next_id += 1
    return tokenizers.Tokenizer.from_str(json.dumps(data))


def english_sentences(count=3000):
    """Deterministic simple English (numbers, punctuation, chat turns included)."""
    rng = np.random.default_rng(20240601)
    subjects = ("the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher",
                "our team", "the river", "a young girl", "the machine", "this book", "the city")
    verbs = ("sees", "likes", "follows", "builds", "finds", "carries", "watches", "helps",
             "opens", "writes about", "walks past", "remembers")
    objects = ("the house", "a red apple", "the long road", "some water", "the garden",
               "a new idea", "the blue sky", "an open door", "the last train", "a quiet song",
               "the market", "every morning")
    tails = (".", "!", "?", ", and then it rains.", " in the evening.", " before lunch.",
             " with great care.", " again and again.")
    questions = ("What is the capital of France?", "How many legs does a spider have?",
                 "Can you tell me a story?", "Why is the sky blue?", "Where is the station?")
    sentences = []
    for i in range(count):
        kind = rng.integers(0, 4)
        if kind == 0:
            sentences.append(f"{rng.choice(questions)} The answer is {rng.integers(0, 1000)}.")
        else:
            sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"
            sentences.append(sentence[0].upper() + sentence[1:] + str(rng.choice(tails)))
    return sentences


def _tokenizer_config(tokenizer, family):
    added = {}
    for token in added_tokens(family):
        added[str(tokenizer.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": token in SPECIAL_TOKENS}
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": chat_template(family),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _init_std(name, shape):
    """Scales that give the random model peaked, input-dependent logits (clear greedy choices)."""
    if name.endswith("norm.weight"):
        return None  # 1 + noise, see random_tensor
    if name.endswith(".bias"):
        return 0.1
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 2.0 / np.sqrt(shape[1])  # logits of std ~2 after the final norm
    # Fan-in scaling keeps activations the same size at any width; the gain above 1 makes each
    # layer outweigh the embedding, so outputs depend on the context (a tied model would
    # otherwise echo its input) and greedy continuations vary instead of repeating one token.
    return 1.5 / np.sqrt(shape[1])


def random_tensor(name, shape, seed):
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(shape, dtype=np.float32)
    std = _init_std(name, shape)
    if std is None:
        values *= 0.1
        values += 1.0
    else:
        values *= std
    return values


def to_bfloat16_bits(values):
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest, ties to even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def _encode(values, dtype):
    if dtype == "bfloat16":
        return to_bfloat16_bits(values)
    return values.astype("<f2" if dtype == "float16" else "<f4", copy=False)


def _write_weights(out_dir, shapes, tensor, dtype, shards, progress):
    """The checkpoint's safetensors files; tensor(name) gives each tensor's float32 values."""
    names = list(shapes)
    code, itemsize = DTYPES[dtype]
    sizes = [int(np.prod(shapes[n])) * itemsize for n in names]
    total = sum(sizes)
    # Contiguous groups in checkpoint order, cut near equal byte counts, none empty.
    groups, shard, start = [[] for _ in range(shards)], 0, 0
    for i, name in enumerate(names):
        if i and (shards * start // total > shard or shards - (len(names) - i) > shard):
            shard += 1
        groups[shard].append(name)
        start += sizes[i]

    if shards == 1:
        filenames = ["model.safetensors"]
    else:
        filenames = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    done = 0
    for filename, group in zip(filenames, groups):
        with open(os.path.join(out_dir, filename), "wb") as f:
            f.write(_safetensors_header({n: shapes[n] for n in group}, code, itemsize))
            for name in group:  # one tensor in memory at a time
                f.write(memoryview(_encode(tensor(name), dtype)))
                done += 1
                if progress:
                    progress(done, len(names), name)
    if shards > 1:
        _write_json(os.path.join(out_dir, "model.safetensors.index.json"), {
            "metadata": {"total_size": total},
            "weight_map": {n: filenames[k] for k, group in enumerate(groups) for n in group}})


def _safetensors_header(shapes, code, itemsize):
    """8-byte little-endian length, then the JSON header padded with spaces to 8 bytes."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        end = offset + int(np.prod(shape)) * itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _check_arguments(*, layers, hidden, heads, kv_heads, intermediate, vocab, dtype, seed,
                     shards, config_style, max_position, family="qwen2", head_dim=None,
                     rope_theta=ROPE_THETA):
    def bad(why):
        raise MsinferError(f"make-tiny-model: {why}")

    for key, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                       ("kv_heads", kv_heads), ("intermediate", intermediate), ("vocab", vocab),
                       ("shards", shards), ("max_position", max_position)):
        positive_int(value, f"make-tiny-model: {key}={value!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        bad(f"seed={seed!r} must be a non-negative integer")
    if family not in FAMILIES:
        bad(f"family={family!r} must be one of {', '.join(FAMILIES)}")
    if head_dim is not None:
        positive_int(head_dim, f"make-tiny-model: head_dim={head_dim!r}")
        if head_dim % 2:
            bad(f"head_dim={head_dim} must be even (rotary embedding)")
    else:
        if hidden % heads:
            bad(f"hidden={hidden} is not divisible by heads={heads} (or give head_dim)")
        if hidden // heads % 2:
            bad(f"head size hidden/heads={hidden // heads} must be even (rotary embedding)")
    if heads % kv_heads:
        bad(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if family in FAMILIES and vocab < 256 + len(added_tokens(family)):
        bad(f"vocab={vocab} must be at least {256 + len(added_tokens(family))} "
            f"(256 bytes + {family}'s added tokens)")
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) \
            or not rope_theta > 1:
        bad(f"rope_theta={rope_theta!r} must be a number above 1")
    if dtype not in DTYPES:
        bad(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    if config_style not in ("4", "5"):
        bad(f"config_style={config_style!r} must be '4' (transformers 4.x) or '5' (5.x)")
