"""Weights for a tiny Qwen2 that copies spans of its context: an induction circuit written
into the tensors (nothing is trained), so n-gram and draft-model speculative decoding are
accepted on it. Random tiny checkpoints never copy, so proposals drawn from the prompt are
always rejected on them.

The model continues a bigram: at position i it looks for an earlier position j whose two
preceding tokens are the last two tokens, (x[j-2], x[j-1]) == (x[i-1], x[i]), and predicts
x[j]. Matching two tokens, not one, keeps it from copying after every token it happens to
have seen before. Where nothing matches, it attends to an attention sink, a special token
(`sink_tokens`: the tokenizer's, e.g. <|im_start|> that chat prompts start with, or
<|endoftext|>), whose value is zero: the random part of the network then chooses the next
token. Prompts without a sink token still copy; where nothing matches, the induction head
then copies the context token whose bigram code is nearest, from no particular place.

The residual stream is split into subspaces, each token's identity being a +-1 code of
`code_dims` entries (any two codes differ in a fifth of their entries or more; sink
tokens' code is zero):
    const | T: this token | P1: token i-1 | P2: token i-2 | HQ | HK | O | SINK | F: free
- layer 0's attention: two positional heads (constant q and k from the biases, the rotary
  embedding turning them into a score that peaks at offset 1, resp. 2) copy T of the
  previous two tokens into P1 and P2;
- layer 0's MLP: a bigram code by elementwise products (a SwiGLU unit pair with gates +g, -g
  computes (g.x)(u.x) exactly, as silu(z) - silu(-z) = z): HQ = T * shift(P1) (the bigram
  ending here), HK = P1 * shift(P2) (the bigram ending one token back);
- layer 1's attention: an induction head, query HQ, key HK, on the rotary pairs whose
  frequency is so low that they hardly turn over the whole context (a match scores the same
  near or far), value T, written to O; a sink token scores SINK_SCORE of a full match
  (from its SINK entry and a constant query), more than any partial one;
- lm_head reads O as the copied token's logits (COPY_LOGIT for a full match), and where
  nothing is copied a random function of the last two tokens (a random readout of HQ) and
  of F decides.
Everything else (the other heads, layer 1's MLP, layers 2 and on) is random and writes only
F, so the network is a real one whose filler sets the choice where nothing is copied: a
draft and a target of different depth on the same seed copy alike and differ elsewhere.
"""
import dataclasses
import zlib

import numpy as np

from ..errors import MsinferError

CODE_DIMS = 32  # at most; what the head and hidden sizes hold (code_dims), 24 at least
MIN_CODE_DIMS = 24
MIN_FREE_DIMS = 8  # F: what the random filler writes
# A rotary pair is static when it turns less than this (radians) over max_position: the
# induction head matches on such pairs only.
STATIC_ANGLE = 0.5
# Softmax logit margins: positional heads' peak over any other offset; induction score per
# code entry that agrees (a full match beats any partial one by 2 x a fifth of the entries).
POSITION_MARGIN = 40.0
MATCH_SCALE = 6.0
SINK_SCORE = 0.8  # of a full match; partial matches score <= 0.6 of it
COPY_LOGIT = 150.0  # the copied token's logit (other tokens: <= 0.6 of it)
# Where nothing is copied: logits from a random readout of HQ, the code of the last two
# tokens (a random function of them, of spread BIGRAM_LOGIT / sqrt(code_dims): a walk that
# repeats no bigram, so it starts no copy of itself, unlike a function of the last token,
# which loops once it comes back to a token), plus a random readout of F of this spread,
# that decides now and then (the depth's filler writes F: a draft and its target differ).
BIGRAM_LOGIT = 40.0
FALLBACK_LOGIT_STD = 1.0
FILLER_GAIN = 0.25  # size of each random block's output into F
# What one attention or MLP block adds to |F|^2 at FILLER_GAIN (measured: about 8 x gain^2).
FILLER_BLOCK_ENERGY = 8 * FILLER_GAIN ** 2
EMBED_FREE_NORM = 2.0  # each token's random part in F (the embedding's contribution to F)
# A sink token's SINK entry, over a code's norm: large, so that the norm at a sink position,
# and with it the sink's key, hardly depends on what else that position holds.
SINK_EMBED = 10.0


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each subspace of the residual stream lies (slices of hidden)."""
    hidden: int
    code_dims: int

    def at(self, k):
        return slice(1 + k * self.code_dims, 1 + (k + 1) * self.code_dims)

    const = 0
    T = property(lambda self: self.at(0))
    P1 = property(lambda self: self.at(1))
    P2 = property(lambda self: self.at(2))
    HQ = property(lambda self: self.at(3))
    HK = property(lambda self: self.at(4))
    O = property(lambda self: self.at(5))
    SINK = property(lambda self: 1 + 6 * self.code_dims)
    F = property(lambda self: slice(2 + 6 * self.code_dims, self.hidden))

    def energy(self, subspaces):
        """Expected squared norm of the residual holding const + `subspaces` codes and F."""
        return self.code_dims * (1 + subspaces) + EMBED_FREE_NORM ** 2


def static_pairs(config):
    """Rotary pair indices (low to high frequency) that turn by at most STATIC_ANGLE over
    max_position_embeddings."""
    freqs = rotary_frequencies(config)
    return [m for m in np.argsort(freqs) if freqs[m] * config.max_position_embeddings
            <= STATIC_ANGLE]


def rotary_frequencies(config):
    half = config.head_dim // 2
    return config.rope_theta ** (-np.arange(half, dtype=np.float64) * 2 / config.head_dim)


def code_dims(config):
    """Token code length: what the static rotary pairs (one kept for the sink) and the hidden
    size hold."""
    return max(0, min(CODE_DIMS, 2 * (len(static_pairs(config)) - 1),
                      (config.hidden_size - 2 - MIN_FREE_DIMS) // 6 // 2 * 2))


def check_copying_config(config):
    """Refuses shapes the circuit does not fit in, naming what to change."""
    def bad(why):
        raise MsinferError(f"make-tiny-model --copying: {why}")

    if config.model_type != "qwen2":
        bad(f"family {config.model_type} has no q/k/v biases the positional heads need; "
            "use qwen2 (dense)")
    if config.tie_word_embeddings:
        bad("the lm_head reads the copy subspace, not the embedding: use --no-tie")
    if config.num_layers < 2:
        bad(f"layers={config.num_layers}: the circuit takes 2 layers")
    if config.num_heads < 2:
        bad(f"heads={config.num_heads}: layer 0 needs 2 positional heads")
    dims = code_dims(config)
    if dims < MIN_CODE_DIMS:
        bad(f"token codes of {dims} entries are too short ({MIN_CODE_DIMS} or more): the "
            f"induction head needs {MIN_CODE_DIMS // 2 + 1} rotary pairs turning by <= "
            f"{STATIC_ANGLE} rad over max_position={config.max_position_embeddings} (has "
            f"{len(static_pairs(config))} at head_dim={config.head_dim}, rope_theta="
            f"{config.rope_theta:g}: raise head_dim or rope_theta, or lower max_position) "
            f"and hidden >= {6 * MIN_CODE_DIMS + 2 + MIN_FREE_DIMS} (is {config.hidden_size})")
    if config.head_dim < dims:
        bad(f"head_dim={config.head_dim} is below the code length {dims}")
    if config.intermediate_size < 4 * dims:
        bad(f"intermediate={config.intermediate_size}: the bigram code takes {4 * dims} units")
    if config.vocab_size > 4096:
        bad(f"vocab={config.vocab_size}: the codes of {dims} entries keep at most 4096 tokens "
            "apart")


def copying_weights(config, seed, sink_tokens=()):
    """{tensor name: float32 array} of the copying checkpoint `config` describes (a Qwen2
    ModelConfig that check_copying_config accepts); `sink_tokens`: ids that are never copied
    nor generated, and that the induction head attends to where nothing matches. Same
    arguments, same values; the circuit (codes, layers 0 and 1, lm_head's copy part)
    depends on the seed and the shape but not on the layer count."""
    check_copying_config(config)
    layout = Layout(config.hidden_size, code_dims(config))
    codes = token_codes(config.vocab_size, layout.code_dims, seed)
    sinks = np.zeros(config.vocab_size, bool)
    sinks[list(sink_tokens)] = True
    codes[sinks] = 0
    rng = _Random(seed)
    weights = {name: rng.filler(name, shape, layout)
               for name, shape in config.parameter_shapes().items()}
    _embedding(weights, codes, sinks, layout, rng)
    _positional_heads(weights, config, layout)
    _bigram_mlp(weights, config, layout)
    _induction_head(weights, config, layout)
    _lm_head(weights, codes, sinks, config, layout, rng)
    return weights


def token_codes(vocab, dims, seed):
    """(vocab, dims) +-1 codes, any two differing in dims // 5 entries or more: random draws,
    each kept if far enough from those kept before (codes of 24 entries or more hold 4096
    tokens so)."""
    rng = np.random.default_rng([seed, zlib.crc32(b"token codes")])
    kept = np.empty((vocab, dims), np.float32)
    count, most_alike = 0, dims - 2 * (dims // 5)  # agreement - disagreement = dims - 2 x distance
    for _ in range(50):
        for code in rng.choice(np.float32([-1, 1]), size=(vocab, dims)):
            if count == 0 or (kept[:count] @ code).max() <= most_alike:
                kept[count] = code
                count += 1
                if count == vocab:
                    return kept
    raise MsinferError(f"make-tiny-model --copying: found {count} of {vocab} token codes of "
                       f"{dims} entries far enough apart")


class _Random:
    """Random values per tensor name, seeded by (seed, name)."""

    def __init__(self, seed):
        self.seed = seed

    def normal(self, name, shape, std):
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def filler(self, name, shape, layout):
        """A tensor of the random network around the circuit: norms 1, biases 0 (those the
        circuit uses are set later); projections reading the residual at fan-in scale; those
        writing it (o_proj, down_proj) write F only, at FILLER_GAIN."""
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        if name.endswith(".bias"):
            return np.zeros(shape, np.float32)
        values = self.normal(name, shape, 1.0 / np.sqrt(shape[-1]))
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            writes = np.zeros(shape, np.float32)
            writes[layout.F] = values[layout.F] * FILLER_GAIN
            return writes
        if name != "lm_head.weight" and shape[-1] == layout.hidden:
            # Not the constant entry: what every position reads alike would push F one
            # way everywhere, and the same few tokens would win wherever F decides.
            values[:, layout.const] = 0
        return values


def _embedding(weights, codes, sinks, layout, rng):
    embed = weights["model.embed_tokens.weight"]
    embed[:] = 0
    embed[:, layout.const] = np.sqrt(layout.code_dims)  # as much energy as the code
    embed[:, layout.T] = codes
    embed[sinks, layout.SINK] = SINK_EMBED * np.sqrt(layout.code_dims)
    free = rng.normal("embedding free part", (len(codes), layout.F.stop - layout.F.start), 1)
    embed[:, layout.F] = free / np.linalg.norm(free, axis=1, keepdims=True) * EMBED_FREE_NORM


def _rms(layout, subspaces):
    return np.sqrt(layout.energy(subspaces) / layout.hidden)


def _positional_heads(weights, config, layout):
    """Layer 0, query heads 0 and 1: attention to offset 1 (2) alone, whatever the tokens;
    their values are T, written to P1 (P2)."""
    p, d, kv_groups = "model.layers.0.self_attn.", config.head_dim, config.kv_groups
    freqs = rotary_frequencies(config)
    turning = np.ones(d // 2, bool)
    turning[static_pairs(config)] = False
    # score(offset) = sum_m a_m cos(w_m (offset - target)); weights ~ sqrt(w) make the target
    # offset a sharp maximum over the whole context (its neighbours come closest).
    a = np.where(turning, np.sqrt(freqs), 0.0)
    a /= a.sum()
    gap = min(_peak_gap(a, freqs, config.max_position_embeddings, target) for target in (1, 2))
    radius = np.sqrt(a * POSITION_MARGIN / gap * np.sqrt(d))  # q.k / sqrt(d) = margin / gap
    for head, target, written in ((0, 1, layout.P1), (1, 2, layout.P2)):
        group = head // kv_groups
        rows = slice(group * d, (group + 1) * d)
        weights[p + "k_proj.weight"][rows] = 0
        weights[p + "k_proj.bias"][rows] = np.concatenate([radius, np.zeros(d // 2)])
        weights[p + "v_proj.weight"][rows] = 0
        weights[p + "v_proj.weight"][rows][:layout.code_dims, layout.T] = (
            np.eye(layout.code_dims) * _rms(layout, 1))
        q = slice(head * d, (head + 1) * d)
        weights[p + "q_proj.weight"][q] = 0
        weights[p + "q_proj.bias"][q] = np.concatenate(
            [radius * np.cos(freqs * target), -radius * np.sin(freqs * target)])
        weights[p + "o_proj.weight"][:, q] = 0
        weights[p + "o_proj.weight"][written, q][:, :layout.code_dims] = np.eye(layout.code_dims)


def _peak_gap(a, freqs, positions, target):
    offsets = np.arange(positions)
    score = np.cos(np.outer(offsets - target, freqs)) @ a
    return score[target] - np.delete(score, target).max()


def _bigram_mlp(weights, config, layout):
    """Layer 0's MLP, units 0 .. 4 x code_dims - 1: HQ = T * shift(P1), HK = P1 * shift(P2),
    entry by entry (+-1 each)."""
    p, n = "model.layers.0.mlp.", layout.code_dims
    gate, up, down = (weights[p + k + "_proj.weight"] for k in ("gate", "up", "down"))
    scale = _rms(layout, 3) ** 2  # undoes the norm on both factors
    unit = 0
    for first, second, out in ((layout.T, layout.P1, layout.HQ), (layout.P1, layout.P2,
                                                                   layout.HK)):
        for r in range(n):
            for sign in (1, -1):
                gate[unit] = 0
                up[unit] = 0
                gate[unit, first.start + r] = sign
                up[unit, second.start + (r + 1) % n] = 1
                down[:, unit] = 0
                down[out.start + r, unit] = sign * scale
                unit += 1


def _induction_head(weights, config, layout):
    """Layer 1, query head 0: query HQ, key HK on the static rotary pairs, a sink token's
    key on the lowest-frequency pair; value T, to O."""
    p, d, n = "model.layers.1.self_attn.", config.head_dim, layout.code_dims
    rms = _rms(layout, 5)
    sink_pair, pairs = static_pairs(config)[0], static_pairs(config)[1:n // 2 + 1]
    dims = np.concatenate([pairs, np.add(pairs, d // 2)])  # both halves of each pair
    strength = np.sqrt(MATCH_SCALE * np.sqrt(d)) * rms  # q.k / sqrt(d) = MATCH_SCALE per entry
    for proj, read in (("q_proj", layout.HQ), ("k_proj", layout.HK)):
        rows = slice(0, d)  # query head 0 and its KV head 0
        weights[p + proj + ".weight"][rows] = 0
        weights[p + proj + ".bias"][rows] = 0
        weights[p + proj + ".weight"][dims, read.start + np.arange(n)] = strength
    # A sink token's key entry is sqrt(n), the query's a constant. At a sink position the
    # residual holds const, SINK, P1, P2 and HK (1.5 codes on average: P1, P2 are zero at the
    # start), and F.
    sink_rms = np.sqrt((layout.energy(1.5) + (SINK_EMBED ** 2) * layout.code_dims)
                       / layout.hidden)
    weights[p + "k_proj.weight"][sink_pair, layout.SINK] = sink_rms / SINK_EMBED
    weights[p + "q_proj.bias"][sink_pair] = (
        SINK_SCORE * n * MATCH_SCALE * np.sqrt(d) / np.sqrt(n))
    weights[p + "v_proj.weight"][:d] = 0
    weights[p + "v_proj.bias"][:d] = 0
    weights[p + "v_proj.weight"][:n, layout.T] = np.eye(n) * rms
    weights[p + "o_proj.weight"][:, :d] = 0
    weights[p + "o_proj.weight"][layout.O, :n] = np.eye(n)


def _lm_head(weights, codes, sinks, config, layout, rng):
    """The copied token's logit from O; where nothing is copied, a random readout of HQ (the
    last two tokens) and of F; sink tokens' logits are 0, below the best of the others."""
    head = weights["lm_head.weight"]
    head[:] = 0
    rms = _rms(layout, 6)
    head[:, layout.O] = codes * (COPY_LOGIT * rms / layout.code_dims)
    signs = np.sign(rng.normal("bigram readout", (len(codes), layout.code_dims), 1))
    head[:, layout.HQ] = signs * (BIGRAM_LOGIT * rms / layout.code_dims)
    free = layout.F.stop - layout.F.start
    free_norm = np.sqrt(EMBED_FREE_NORM ** 2 + 2 * config.num_layers * FILLER_BLOCK_ENERGY)
    readout = rng.normal("lm_head free part", (len(codes), free), 1.0)
    # Rows of one norm: no token wins more often than others where F decides.
    readout *= FALLBACK_LOGIT_STD * np.sqrt(free) * rms / free_norm / np.linalg.norm(
        readout, axis=1, keepdims=True)
    head[:, layout.F] = readout
    head[sinks] = 0
