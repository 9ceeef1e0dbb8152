"""What a compiled call holds besides weights and KV cache, and so how many decoder layers one
graph may run.

MindSpore's CPU backend keeps every intermediate of a compiled graph at once (measured: a
graph's resident memory grows with its layer count), so a graph of k layers holds k times one
layer's activations. The planner reserves one layer of the engine's largest call (a
max_prefill_tokens chunk, or a max_num_seqs decode step, over max_len of context); each call
then runs as many consecutive layers per graph as fit in that reserve: one layer for the
largest chunk, all layers for a short decode step. Fewer graph launches per step is what
makes decoding fast (24 layer calls per step cost 0.5B-shape batch-1 decode 1.5x the time of
one call of all 24, measured in bench/profile_step.py), and the reserve keeps it honest.
"""


def layer_activation_bytes(config, shard, dtype_bytes, tokens, groups, context):
    """An upper estimate of what one decoder layer of a call holds: `tokens` tokens in `groups`
    groups, each group over `context` gathered cache slots (a prefill chunk is one group; a
    decode step is one group per sequence). Hidden- and intermediate-size tensors per token,
    the gathered K/V context and its by-head copy, float32 scores, mask and softmax."""
    heads, kv = shard.local_heads, shard.local_kv_heads
    intermediate = shard.local_shape("model.layers.0.mlp.down_proj.weight")[1]
    per_token = dtype_bytes * (6 * config.hidden_size + 2 * (heads + 2 * kv) * config.head_dim
                               + 4 * intermediate)
    gathered = 4 * groups * context * kv * config.head_dim * dtype_bytes
    scores = 3 * tokens * heads * context * 4 + tokens * context * 4
    return tokens * per_token + gathered + scores


def largest_call_bytes(config, shard, dtype_bytes, max_len, max_prefill_tokens, max_num_seqs):
    """One layer of the engine's largest call: the activations the planner reserves."""
    prefill = layer_activation_bytes(config, shard, dtype_bytes, max_prefill_tokens, 1, max_len)
    decode = layer_activation_bytes(config, shard, dtype_bytes, max_num_seqs, max_num_seqs,
                                    max_len)
    return max(prefill, decode)


def layers_per_graph(num_layers, layer_bytes, budget_bytes):
    """The most consecutive layers, a divisor of num_layers (so one compiled graph serves every
    run of them), whose activations stay within the budget; at least one."""
    fit = max(1, budget_bytes // max(1, layer_bytes))
    return max(k for k in range(1, num_layers + 1) if num_layers % k == 0 and k <= fit)
