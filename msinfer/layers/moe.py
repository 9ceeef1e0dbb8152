"""A sparse mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k
experts, each a SwiGLU MLP, and sums their outputs weighted by the router's scores; Qwen2-MoE
adds a shared expert, gated per token by a sigmoid.

Routing is HF's (modeling_qwen2_moe.py / qwen3_moe): router logits x @ gate.T, softmax in
float32 over all experts, top-k, renormalised to sum 1 only with norm_topk_prob, cast back to
the activation dtype.

The experts of a layer are stacked, (experts, 2 x intermediate, hidden) for gate/up (gate rows
first, as transformers fuses them) and (experts, hidden, intermediate) for down, and placed by
the shard plan:
- tensor-sharded (`colwise`/`rowwise`, the default): every rank holds its slice of every
  expert's intermediate width and computes a partial sum of every routed expert;
- expert parallel (`expert`): every rank holds num_experts / tensor whole experts and computes
  the routed experts it holds (the others weigh 0 there).
Either way the partial sums, with the shared expert's (split as a dense MLP), are summed by
one AllReduce per layer, as the dense MLP's.

The cost grows with the routed experts, not all of them: each (token, expert) pair gathers
that expert's weights (this rank's slice) and multiplies its token by them (a batched matmul
of N x k pairs of one row each). The shapes are those of the tokens, so the form runs in any
graph, static or dynamic. It copies each routed expert's slice once per pair: right for
decode (a few tokens; the weights are read once either way), expensive for long prefill
chunks, where grouping the pairs by expert (MindSpore's GroupedMatmul on Ascend) reads each
expert once.
"""
import mindspore as ms
from mindspore import nn, ops
from mindspore.ops.auto_generate import SiLU

from .mlp import SwiGLU


class SparseMoE(nn.Cell):
    """The sparse MLP of `prefix` (e.g. "model.layers.1.mlp", a sparse layer's). construct(x,
    router, experts_gate_up, experts_down[, shared gate_up, shared down, shared gate])."""

    def __init__(self, ctx, prefix):
        super().__init__()
        config, plan = ctx.config, ctx.plan
        moe = config.moe
        self.top_k = moe.num_experts_per_tok
        self.renormalise = moe.norm_topk_prob
        self.hidden = config.hidden_size
        stacked = prefix + ".experts.gate_up_proj.weight"
        experts = plan.local_experts(stacked, ctx.tensor_rank)
        # Expert parallel: routed experts outside [first, first + count) weigh 0 here.
        self.expert_parallel = len(experts) < moe.num_experts
        self.first_expert, self.local_experts = experts.start, len(experts)
        # colwise / expert placement leave every rank a partial sum; replicate the whole
        self.reduce = (ctx.all_reduce() if ctx.explicit_collectives
                       and plan.style(stacked) != "replicate" else None)
        self.shared = None
        if moe.shared_expert_intermediate:
            self.shared = SwiGLU(ctx, prefix + ".shared_expert",
                                 moe.shared_expert_intermediate, reduce=False)
        self.router = ops.MatMul(transpose_b=True)
        self.to_float = ops.Cast()
        self.to_dtype = ops.Cast()
        self.softmax = ops.Softmax(-1)
        self.topk = ops.TopK(sorted=True)
        self.pick = ops.Gather()
        self.pair_matmul = ops.BatchMatMul(transpose_b=True)
        self.silu = SiLU()
        self.halves = ops.Split(-1, 2)
        self.sigmoid = ops.Sigmoid()

    def construct(self, x, w_router, w_gate_up, w_down, *shared):
        weights, ids = self._route(x, w_router)
        out = self._experts(x, weights, ids, w_gate_up, w_down)
        if self.shared is not None:
            w_shared_gate_up, w_shared_down, w_shared_gate = shared
            gate = self.sigmoid(self.router(x, w_shared_gate))  # (tokens, 1)
            out = out + gate * self.shared(x, w_shared_gate_up, w_shared_down)
        if self.reduce is not None:
            out = self.reduce(out)
        return out

    def _route(self, x, w_router):
        """(tokens, k) weights in x's dtype and expert numbers of each token's top-k."""
        probs = self.softmax(self.to_float(self.router(x, w_router), ms.float32))
        weights, ids = self.topk(probs, self.top_k)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdims=True)
        return self.to_dtype(weights, x.dtype), ids

    def _experts(self, x, weights, ids, w_gate_up, w_down):
        """Sum over each token's k experts of weight x expert(x), this rank's part of it."""
        if self.expert_parallel:
            local = ids - self.first_expert
            held = ops.logical_and(local >= 0, local < self.local_experts)
            weights = weights * held.astype(weights.dtype)
            ids = ops.where(held, local, ops.zeros_like(local))
        k = self.top_k
        pairs = ids.reshape(-1)  # token t's experts at rows t*k .. t*k + k - 1
        rows = ops.tile(x.expand_dims(1), (1, k, 1)).reshape(-1, 1, self.hidden)
        gate_up = self.pair_matmul(rows, self.pick(w_gate_up, pairs, 0))  # (pairs, 1, 2I)
        gate, up = self.halves(gate_up)
        act = self.silu(gate) * up
        y = self.pair_matmul(act, self.pick(w_down, pairs, 0))  # (pairs, 1, hidden)
        y = y.reshape(-1, k, self.hidden) * weights.expand_dims(-1)
        return y.sum(1)
