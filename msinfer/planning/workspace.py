"""What a compiled call holds besides weights and KV cache, and so how many decoder layers one
graph may run.

A call's activations are transient: MindSpore takes them from its memory pool and frees each
after its last use, so graphs share the pool and a graph of k layers peaks a little above one
layer (measured: docs/engine.md, "Measured figures behind the code", as every figure this
module rests on). The planner reserves one layer of the engine's largest
call (a max_prefill_tokens chunk, or a max_num_seqs decode step, over max_model_len of context), an
upper estimate; each call then runs a pass over the layers in at most CALLS_PER_PASS graphs,
with no more layers per graph than fit in that reserve, each layer past a graph's first
adding the hardware profile's `layer_peak_growth` of a layer to its peak. Where unmeasured
that is 1.0 (every layer's activations held: one layer per graph for the largest chunk, a
quarter of the layers for a short decode step); on the CPU backend 0.15: a process's peak RSS
grew by less than that fraction of this module's estimate of one layer for each layer past
the first (compilation included). Few graph launches per step is what makes decoding fast
(24 one-layer calls per step cost batch-1 decode markedly more than one 24-layer call).

What a compiled graph holds for its lifetime on the CPU backend is not its activations but
its kernels' index tables: a broadcasting Add/Mul and a Transpose keep an int64 index per
output element. Explicit mode avoids them where they are large (layers/cpu_forms.Expand,
CacheLayout.rows_by_head); what is left, a prefill chunk's query and output transposes, is
8 bytes per element of those tensors.

On the CPU backend the reserve is two layers and a graph runs at least two (hardware profile
`min_layers_per_graph`): MindSpore runs a graph of at most 100 kernels, which one decoder
layer is, partly in the calling thread, which then competes with the runtime's two worker
threads for two cores (perf: the caller spinning in ThreadPool::ParallelLaunch); two-layer
graphs ran a prefill chunk faster than one-layer graphs, four no faster than two.
"""
from ..parallel.strategy import first_layer


def layer_activation_bytes(shard_plan, dtype_bytes, tokens, groups, context):
    """An upper estimate of what one decoder layer of a call holds: `tokens` tokens in `groups`
    groups, each group over `context` gathered cache slots (a prefill chunk is one group; a
    decode step is one group per sequence). Hidden- and intermediate-size tensors per token,
    the gathered K/V context and its by-head copy (semi_auto's; explicit mode gathers by head),
    float32 scores, mask and softmax."""
    config = shard_plan.config
    heads, kv = shard_plan.local_heads, shard_plan.local_kv_heads
    per_token = dtype_bytes * (6 * config.hidden_size + 2 * (heads + 2 * kv) * config.head_dim
                               + mlp_activations(shard_plan))
    gathered = 4 * groups * context * kv * config.head_dim * dtype_bytes
    scores = 3 * tokens * heads * context * 4 + tokens * context * 4
    return tokens * per_token + gathered + scores


def mlp_activations(shard_plan):
    """Elements a token's MLP holds at its peak: 4 x the intermediate width of a dense MLP;
    of a sparse one (layers/moe.py) the router's scores and each of its k routed pairs' row,
    gate/up and output (the pairs' gathered weights are not counted: a grouped matmul reads
    them in place), and the shared expert's as a dense MLP's."""
    config = shard_plan.config
    dense = first_layer(config, sparse=False)
    widest = 0
    if dense is not None:
        widest = 4 * shard_plan.local_shape(f"model.layers.{dense}.mlp.down_proj.weight")[1]
    sparse = first_layer(config)
    if sparse is not None:
        moe, p = config.moe, f"model.layers.{sparse}.mlp."
        experts_down = p + "experts.down_proj.weight"
        intermediate = shard_plan.local_shape(experts_down)[1]
        routed = moe.num_experts + moe.num_experts_per_tok * (2 * config.hidden_size
                                                              + 4 * intermediate)
        if moe.shared_expert_intermediate:
            routed += 4 * shard_plan.local_shape(p + "shared_expert.down_proj.weight")[1]
        widest = max(widest, routed)
    return widest


def largest_call_bytes(shard_plan, dtype_bytes, limits, layers=1):
    """`layers` decoder layers of the engine's largest call (EngineLimits `limits`): the
    activations the planner reserves, and what bounds every compiled graph's."""
    context, seqs = limits.max_model_len, limits.max_num_seqs
    prefill = layer_activation_bytes(shard_plan, dtype_bytes, limits.max_prefill_tokens, 1,
                                     context)
    decode = layer_activation_bytes(shard_plan, dtype_bytes, seqs, seqs, context)
    return layers * max(prefill, decode)


def stack_layers(shard_plan, dtype_bytes, limits, min_layers=1, growth=1.0):
    """layers_for(tokens, groups, context): the decoder layers one graph of explicit mode runs
    for a call of that shape, within the reserve of `min_layers` layers of the largest call,
    each layer past the first adding `growth` of a layer (the hardware profile's
    min_layers_per_graph and layer_peak_growth): what the model runner builds its stacks with
    and the planner counts graphs with."""
    budget = largest_call_bytes(shard_plan, dtype_bytes, limits, layers=min_layers)

    def layers_for(tokens, groups, context):
        layer = layer_activation_bytes(shard_plan, dtype_bytes, tokens, groups, context)
        return layers_per_graph(shard_plan.config.num_layers, layer, budget, min_layers,
                                growth)
    return layers_for


# A pass over the layers takes at most this many graph calls when memory allows: more layers
# per graph buy little past it (batch-1 decode as fast with 6 layers per graph as with 24:
# docs/engine.md, "Measured figures behind the code").
CALLS_PER_PASS = 4


def layers_per_graph(num_layers, layer_bytes, budget_bytes, min_layers=1, growth=1.0):
    """Consecutive layers per graph: a divisor of num_layers (so one compiled graph serves
    every run of them), the fewest that keep a pass within CALLS_PER_PASS calls and at least
    `min_layers`, fewer when their peak, one layer's activations and `growth` of that for each
    further layer, would exceed the budget; at least one."""
    divisors = [k for k in range(1, num_layers + 1) if num_layers % k == 0]
    enough = min((k for k in divisors if num_layers // k <= CALLS_PER_PASS and k >= min_layers),
                 default=num_layers)
    layer = max(1, layer_bytes)
    fit = max([k for k in divisors if layer + growth * (k - 1) * layer <= budget_bytes],
              default=1)
    return max(k for k in divisors if k <= min(max(enough, min_layers), fit))
