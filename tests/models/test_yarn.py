"""Static YaRN rope scaling (Qwen2.5 beyond 32K: rope_scaling {type yarn, factor 4,
original_max_position_embeddings 32768}) against Hugging Face transformers: the cos/sin tables
against its rotary embedding module, and the engine against its Qwen2ForCausalLM on a random
checkpoint whose small original_max_position_embeddings (32) puts a short prompt's positions
past it, config.json spelled as released Qwen2.5 checkpoints spell it."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_parity import (ENGINE, NEW_TOKENS, assert_matches_hf, greedy,  # noqa: E402
                         prompts_for)
from test_parity import hf_checkpoint  # noqa: E402,F401  (the session fixture)

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from msinfer import LLM  # noqa: E402
from msinfer.config import ModelConfig  # noqa: E402
from msinfer.layers.rotary import rotary_tables, yarn_inv_freq  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# test_yarn's checkpoint (test_distributed's dp2 x tp2 job runs it too)
YARN_CASE = dict(family="qwen2", heads=8, kv_heads=2, rope=YARN, config_style="4", seed=3)


def hf_tables(config, positions):
    """transformers' cos/sin for `positions` (its rotary embedding module of the config)."""
    rotary = transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding(config)
    x = torch.zeros(1, len(positions), 8, dtype=torch.float32)
    cos, sin = rotary(x, torch.tensor([positions]))
    return cos[0].numpy(), sin[0].numpy()


@pytest.mark.parametrize("head_dim, theta, rope", [
    (8, 1e6, YARN),
    (128, 1e6, {"rope_type": "yarn", "factor": 4.0,
                "original_max_position_embeddings": 32768}),  # Qwen2.5's recipe
    (64, 1e4, dict(YARN, factor=2.5, beta_fast=16.0, beta_slow=2.0)),
    (16, 1e6, dict(YARN, truncate=False)),
    (32, 1e6, dict(YARN, attention_factor=1.5)),
    (32, 1e6, dict(YARN, mscale=1.0, mscale_all_dim=0.5)),
])
def test_cos_sin_tables_are_transformers(head_dim, theta, rope):
    heads = 4
    max_len = 4 * rope["original_max_position_embeddings"]
    config = transformers.Qwen2Config(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_len, rope_parameters=dict(rope, rope_theta=theta))
    ours = ModelConfig.from_dict(config.to_dict())
    assert ours.rope_scaling.rope_type == "yarn"
    inv_freq, attention_factor = yarn_inv_freq(head_dim, ours.rope_theta, ours.rope_scaling)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert attention_factor == hf_factor
    # float32 powers: numpy's and torch's differ in the last bit for some exponents
    np.testing.assert_allclose(inv_freq, hf_inv_freq.numpy(), rtol=2.5e-7, atol=0)
    positions = sorted({0, 1, 7, 31, 32, 33, 100, max_len // 2, max_len - 1})
    cos, sin = rotary_tables(head_dim, ours.rope_theta, max_len, ours.rope_scaling)
    hf_cos, hf_sin = hf_tables(config, positions)
    # ... which a position multiplies: position p's angles may differ by p x 1 ulp of inv_freq
    # (about 0.008 at 131,071 in transformers' own float32 tables too)
    bound = 2e-6 + 1.5e-7 * attention_factor * np.array(positions, np.float64)[:, None]
    assert (np.abs(cos[positions] - hf_cos) <= bound).all()
    assert (np.abs(sin[positions] - hf_sin) <= bound).all()
    plain_cos, _ = rotary_tables(head_dim, ours.rope_theta, max_len)
    assert np.abs(plain_cos[positions] - cos[positions]).max() > 1e-2  # yarn changes them


@pytest.fixture(scope="module")
def yarn_case(hf_checkpoint):
    """Qwen2 (q/k/v biases, 8 query heads over 2 KV heads), bfloat16, yarn factor 4 over an
    original context of 32 positions, config.json in transformers 4.x's spelling."""
    path, config, hf = hf_checkpoint("qwen2_yarn", **YARN_CASE)
    return path, config, LLM(path, **ENGINE), hf


def test_the_checkpoint_is_qwen25s_yarn_recipe_at_a_small_scale(yarn_case):
    path, config, llm, hf = yarn_case
    with open(f"{path}/config.json") as f:
        raw = __import__("json").load(f)
    assert raw["rope_scaling"] == {"type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 32}
    assert "rope_parameters" not in raw and raw["torch_dtype"] == "bfloat16"
    assert hf.config.rope_parameters["rope_type"] == "yarn"  # transformers reads it as yarn
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(0.1 * np.log(4) + 1)
    assert config.rope_scaling.factor == 4.0 and config.max_context_len == 128


def test_logprobs_and_32_greedy_tokens_match_transformers_with_yarn(yarn_case):
    """Prompts of 5, 11, 37 and 1 token and 32 generated: positions up to 68, past the
    original 32 (and the scaled frequencies and attention factor apply at every position)."""
    path, config, llm, hf = yarn_case
    prompts = prompts_for(config.vocab_size, seed=11)
    outs = llm.generate(prompts, greedy(config.vocab_size))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert len(out.token_ids) == NEW_TOKENS
        assert_matches_hf(hf, prompt, out, config.vocab_size, f"yarn prompt {i}")


def test_without_yarn_the_tokens_would_differ(yarn_case):
    """The check above can fail: the same weights under the default rotary embedding give
    other log-probs (so the engine's yarn tables are what made them match)."""
    path, config, llm, hf = yarn_case
    prompt = prompts_for(config.vocab_size, seed=11)[2]
    plain = transformers.Qwen2ForCausalLM.from_pretrained(
        path, dtype=torch.float32, rope_parameters={"rope_type": "default",
                                                    "rope_theta": config.rope_theta}).eval()
    assert plain.config.rope_parameters["rope_type"] == "default"
    with torch.no_grad():
        ids = torch.tensor([prompt])
        diff = (torch.log_softmax(plain(ids).logits, -1)
                - torch.log_softmax(hf(ids).logits, -1)).abs().max().item()
    assert diff > 0.1
