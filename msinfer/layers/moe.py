"""A sparse mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k
experts, each a SwiGLU MLP, and sums their outputs weighted by the router's scores; Qwen2-MoE
adds a shared expert, gated per token by a sigmoid.

Routing is HF's (modeling_qwen2_moe.py / qwen3_moe): router logits x @ gate.T, softmax in
float32 over all experts, top-k, renormalised to sum 1 only with norm_topk_prob (computed as
the softmax of the top-k logits, the same numbers), cast back to the activation dtype.

The experts of a layer are stacked, (experts, 2 x intermediate, hidden) for gate/up (gate rows
first, as transformers fuses them) and (experts, intermediate, hidden) for down (the
checkpoint's transposed at load: models/moe_family.weight_layout), and placed by the shard
plan:
- tensor-sharded (`colwise`/`rowwise`, the default): every rank holds its slice of every
  expert's intermediate width and computes a partial sum of every routed expert;
- expert parallel (`expert`): every rank holds num_experts / tensor whole experts and computes
  the routed experts it holds (the others weigh 0 there).
Either way the partial sums, with the shared expert's (split as a dense MLP), are summed by
one AllReduce per layer, as the dense MLP's.

The cost grows with the routed experts, not all of them: no token is multiplied by an expert
that did not route it. On CPU where g++ builds it (`uses_cpu_kernel`), a C++ kernel computes
the routed experts of every call, decode and prefill, reading the stacked experts where they
lie (layers/cpu_kernels/moe_experts.cc: the pairs grouped by expert, so an expert is read once
per call however many tokens route to it; on MindSpore's CPU threads' count). Elsewhere, two
MindSpore forms of static shape, by the P = tokens x k (token, expert) pairs of a call:
- by token (`_by_token`: decode steps, and calls whose rows a graph does not fix): each pair
  gathers its expert's weights (this rank's slice), and each token is multiplied by its k
  experts side by side, as by a dense MLP k experts wide (one batched matmul per projection,
  a token per batch; the down projection sums the k experts' outputs, weighted before it).
  Its shapes follow the tokens, so it runs in graphs of dynamic rows; it copies an expert's
  slice once per pair.
- grouped (`_grouped`: graphs of static rows with more pairs than experts, i.e. prefill
  chunks): the pairs sorted by expert, each expert's run padded to whole blocks of `block`
  rows, one batched matmul over the blocks (each block's expert gathered once), the rows
  summed back to their tokens. At most ceil(P / block) + min(experts, P) blocks whatever the
  routing, so its shapes are fixed by the graph's rows; block = P // experts keeps that
  within about two blocks per expert.
Both copy the routed experts' weights (ops.Gather), the cost that decode pays over a dense MLP
of the same active size on CPU, which the kernel avoids; MindSpore 2.10 has no CPU grouped
matmul, and the CPU ops that read experts in place (SelectExtView per pair,
SparseTensorDenseMatmul) measured slower than the copy (bench/moe_forms.py, docs/moe.md).

On Ascend (`uses_moe_primitives`: with `uses_cpu_kernel` the one place the form is chosen by
hardware) the experts are MindSpore's MoE primitives instead (`PrimitiveExperts`), which have
kernels there only; the MindSpore forms above are the reference, and what every other backend
runs.
"""
import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.ops import moe_init_routing_v2, moe_token_unpermute
from mindspore.ops.auto_generate import SiLU, grouped_matmul

from ..parallel.distributed import cpu_threads
from .. import hardware
from . import cpu_kernels
from .mlp import SwiGLU


def uses_moe_primitives(device_target=None) -> bool:
    """Whether the experts run as MindSpore's MoE primitives (`PrimitiveExperts`): on Ascend,
    where MoeInitRoutingV2, GroupedMatmul and MoeTokenUnpermute have kernels (on CPU none of
    them has one). device_target: a hardware profile's, or this process's MindSpore's."""
    if device_target is None:
        device_target = ms.get_context("device_target")
    return device_target == "Ascend"


def uses_cpu_kernel(device_target=None) -> bool:
    """Whether the experts run as the C++ kernel (`experts_kernel`): on CPU, where this host's
    g++ can build it."""
    if device_target is None:
        device_target = ms.get_context("device_target")
    return device_target == "CPU" and hardware.kernel_compiler_available()


def experts_kernel(dtype):
    """The C++ kernel as a MindSpore op: (x (T, H), ids (T, k) int32 (this rank's numbers;
    outside [0, experts) not held: they add nothing), weights (T, k), gate/up (E, 2I, H),
    down (E, I, H), threads (1,) int32) -> (T, H); x, weights, experts and out of `dtype`,
    float32 or float16."""
    dtype = dtype or ms.float32

    def inputs(name):
        return (name, "I32_Default", name, name, name, "I32_Default")
    name, other = {ms.float32: ("F32_Default", "F16_Default"),
                   ms.float16: ("F16_Default", "F32_Default")}[dtype]
    return cpu_kernels.custom_op("moe_experts", "MoeExperts", inputs(name), dtype,
                                 also=[(*inputs(other), other)])


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
        self.in_float32 = ctx.dtype in (None, ms.float32)  # no casts to make
        self.to_float = ops.Cast()
        self.to_dtype = ops.Cast()
        self.softmax = ops.Softmax(-1)
        self.topk = ops.TopK(sorted=True)
        self.pick = ops.Gather()
        self.pair_matmul = ops.BatchMatMul(transpose_b=True)  # gate/up: (E, 2I, hidden)
        self.down_matmul = ops.BatchMatMul()  # down: (E, I, hidden)
        self.width = plan.local_shape(prefix + ".experts.down_proj.weight")[1]
        self.silu = SiLU()
        self.halves = ops.Split(-1, 2)
        self.sigmoid = ops.Sigmoid()
        self.num_experts = self.local_experts if self.expert_parallel else moe.num_experts
        self.primitives = (PrimitiveExperts(self.num_experts) if uses_moe_primitives()
                           else None)
        self.kernel = None
        if self.primitives is None and uses_cpu_kernel():
            self.kernel = experts_kernel(ctx.dtype)
            self.threads = Tensor(np.array([cpu_threads()], np.int32))
        rows = ctx.graph.rows if ctx.graph is not None else 0
        self.pairs = rows * self.top_k  # 0: rows not fixed when the graph is built
        self.grouped = (self.primitives is None and self.kernel is None
                        and self.pairs > self.num_experts)
        if self.grouped:
            self.block = self.pairs // self.num_experts
            self.blocks = -(-self.pairs // self.block) + min(self.num_experts, self.pairs)
            self.rows = rows
            # the token of each pair, (P,): token t's experts are pairs t*k .. t*k + k - 1
            self.pair_token = Tensor(np.arange(self.pairs, dtype=np.int32) // self.top_k)

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
        """(tokens, k) weights in x's dtype and expert numbers of each token's top-k. Top-k
        of the softmax is top-k of the logits, and the top-k probabilities renormalised are
        the softmax of the top-k logits: with norm_topk_prob only k of them are exponentiated."""
        logits = self.router(x, w_router)
        if not self.in_float32:
            logits = self.to_float(logits, ms.float32)
        if self.renormalise:
            top, ids = self.topk(logits, self.top_k)
            weights = self.softmax(top)
        else:
            weights, ids = self.topk(self.softmax(logits), self.top_k)
        if not self.in_float32:
            weights = self.to_dtype(weights, x.dtype)
        return weights, ids

    def _experts(self, x, weights, ids, w_gate_up, w_down):
        """Sum over each token's k experts of weight x expert(x), this rank's part of it."""
        if self.kernel is not None:  # it skips the experts it is not given
            if self.expert_parallel:
                ids = ids - self.first_expert
            return self.kernel(x, ids, weights, w_gate_up, w_down, self.threads)
        if self.expert_parallel:
            local = ids - self.first_expert
            held = ops.logical_and(local >= 0, local < self.local_experts)
            weights = weights * held.astype(weights.dtype)
            ids = ops.where(held, local, ops.zeros_like(local))
        if self.primitives is not None:
            return self.primitives(x, weights, ids, w_gate_up, w_down)
        if self.grouped:
            return self._grouped(x, weights.reshape(-1), ids.reshape(-1), w_gate_up, w_down)
        return self._by_token(x, weights, ids, w_gate_up, w_down)

    def _expert_mlp(self, rows, w_gate_up, w_down):
        """SwiGLU of each group of `rows` (groups, rows, hidden) by its expert's weights
        (groups, 2I, hidden) and (groups, I, hidden)."""
        gate, up = self.halves(self.pair_matmul(rows, w_gate_up))
        return self.down_matmul(self.silu(gate) * up, w_down)

    def _by_token(self, x, weights, ids, w_gate_up, w_down):
        """weights, ids: (tokens, k). Token t's k experts' gate/up rows one after another,
        (k x 2I, hidden), and their down rows, (k x I, hidden)."""
        k, width, hidden = self.top_k, self.width, self.hidden
        pairs = ids.reshape(-1)  # token t's experts at t*k .. t*k + k - 1
        w_gate_up = self.pick(w_gate_up, pairs, 0).reshape(-1, k * 2 * width, hidden)
        gate_up = self.pair_matmul(x.expand_dims(1), w_gate_up).reshape(-1, k, 2 * width)
        gate, up = self.halves(gate_up)
        act = self.silu(gate) * up * weights.expand_dims(-1)  # (tokens, k, I), weighted
        w_down = self.pick(w_down, pairs, 0).reshape(-1, k * width, hidden)
        return self.down_matmul(act.reshape(-1, 1, k * width), w_down).reshape(-1, hidden)

    def _grouped(self, x, weights, experts, w_gate_up, w_down):
        """weights, experts: (P,) of the pairs. Pair j of the sorted order goes to row
        padded_start[e] + (j - start[e]) of its expert e's run of blocks."""
        e_count, b = self.num_experts, self.block
        _, order = ops.sort(experts.astype(ms.float32))
        sorted_experts = self.pick(experts, order, 0)
        count = ops.one_hot(experts, e_count, Tensor(1, ms.int32), Tensor(0, ms.int32)).sum(0)
        padded = (count + (b - 1)) // b * b
        start = ops.cumsum(count, 0) - count
        padded_start = ops.cumsum(padded, 0) - padded
        row = (self.pick(padded_start, sorted_experts, 0) + ops.arange(self.pairs)
               - self.pick(start, sorted_experts, 0)).astype(ms.int32)
        rows = self.blocks * b
        # Rows no pair fills read token 0, weigh 0 and add into an extra token dropped below.
        token = ops.tensor_scatter_elements(ops.zeros((rows,), ms.int32), row,
                                            self.pick(self.pair_token, order, 0), 0)
        target = ops.tensor_scatter_elements(ops.full((rows,), self.rows, dtype=ms.int32),
                                             row, self.pick(self.pair_token, order, 0), 0)
        weight = ops.tensor_scatter_elements(ops.zeros((rows,), weights.dtype), row,
                                             self.pick(weights, order, 0), 0)
        block_expert = ops.tensor_scatter_elements(ops.zeros((self.blocks,), experts.dtype),
                                                   row // b, sorted_experts, 0)
        grouped = self.pick(x, token, 0).reshape(self.blocks, b, self.hidden)
        y = self._expert_mlp(grouped, self.pick(w_gate_up, block_expert, 0),
                             self.pick(w_down, block_expert, 0))
        y = y.reshape(rows, self.hidden) * weight.expand_dims(-1)
        return ops.unsorted_segment_sum(y, target, self.rows + 1)[:self.rows]


class PrimitiveExperts(nn.Cell):
    """The experts by MindSpore's MoE primitives (Ascend; not run on hardware yet: docs/moe.md),
    as vllm-ascend's 310P MoE chains their torch_npu twins: MoeInitRoutingV2 sorts the (token,
    expert) pairs by expert (x's rows in that order, each pair's row in it, where each
    expert's run ends), GroupedMatmul multiplies each run by its expert's weights where they
    lie, MoeTokenUnpermute puts the rows back and sums each token's k, weighted. Weights as
    GroupedMatmul takes them, (experts, in, out): gate/up (experts, hidden, 2I) (laid out so at
    load: models/moe_family.weight_layout), down (experts, I, hidden)."""

    def __init__(self, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.halves = ops.Split(-1, 2)
        self.silu = SiLU()

    def construct(self, x, weights, ids, w_gate_up, w_down):
        """x: (tokens, hidden); weights, ids: (tokens, k), ids this rank's experts' numbers."""
        rows, row_of_pair, run_ends = moe_init_routing_v2(
            x, ids.astype(ms.int32), active_num=0, expert_capacity=0,
            expert_num=self.num_experts, drop_pad_mode=0,
            expert_tokens_count_or_cumsum_flag=1, expert_tokens_before_capacity_flag=False)
        run_ends = run_ends.astype(ms.int64)  # GroupedMatmul's group_list: cumulative ends
        gate, up = self.halves(grouped_matmul([rows], [w_gate_up], group_list=run_ends,
                                              split_item=3, group_type=0)[0])
        y = grouped_matmul([self.silu(gate) * up], [w_down], group_list=run_ends,
                           split_item=3, group_type=0)[0]
        return moe_token_unpermute(y, row_of_pair, probs=weights)
