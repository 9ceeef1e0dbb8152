"""One rank of a multi-process test job (started by tests/parallel/test_distributed.py under mpirun or
msrun). Runs greedy generation on a batch of prompts, records the logits of the prefill and
the first decode steps, and writes them with this rank's memory figures to OUT/rank_R.npz.
With --sampling (SamplingParams arguments per prompt, as JSON) it writes instead every field
of every output this rank returns to OUT/rank_R.json (output_fields).

Test hooks, once every rank has written its results (so that one job checks both the results
and the failure): MSINFER_TEST_KILL_RANK=r makes rank r SIGKILL itself, MSINFER_TEST_FAIL_RANK=r
makes rank r fail with a user error (its message, exit code 2), each writing the time to
OUT/down_at first; the other ranks meanwhile wait in a collective that the lost rank never
joins, so only the launcher can end them (OUT/rank_R.survived if one ever returns).
--weight-first computes every MLP and lm_head product as (W @ x.T).T, whatever this
processor's forms (hardware.cpu_matmul_forms), so that the sharded lm_head's transposed
gather runs. --model2 DIR runs another checkpoint (e.g. another model family) in the same job
once the first one's results are written (or its --sampling outputs), to OUT/rank_R.model2.npz
(a second --model2 to model3.npz; --model2-strategy: its strategy): one job start, several
models. --speculative-config JSON (and --model2-speculative-config, the n-th --model2's) runs
it with speculative decoding.
"""
import argparse
import dataclasses
import json
import os
import resource
import signal
import sys
import time

import numpy as np


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--strategy", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--sampling", help="JSON list of SamplingParams arguments, one per prompt")
    p.add_argument("--weight-first", action="store_true")
    p.add_argument("--model2", action="append", default=[],
                   help="another checkpoint to run, after the first, in the job (repeatable: "
                        "the n-th writes rank_R.model{n+1}.npz)")
    p.add_argument("--model2-new-tokens", type=int, action="append", default=[],
                   help="the n-th --model2's new tokens; one value: every --model2's "
                        "(default: --new-tokens)")
    p.add_argument("--model2-strategy", action="append", default=[],
                   help="the n-th --model2's strategy (default: --strategy)")
    p.add_argument("--graph-shapes", help="EngineLimits.graph_shapes (default: the engine's)")
    p.add_argument("--speculative-config", help="speculative decoding's settings (JSON)")
    p.add_argument("--model2-speculative-config", action="append", default=[],
                   help="the n-th --model2's speculative decoding settings (default: none)")
    args = p.parse_args()
    os.environ.setdefault("GLOG_v", "3")
    if args.weight_first:
        import msinfer.layers.cpu_forms
        from msinfer.hardware import CpuMatmulForms

        forms = CpuMatmulForms(in_out=False, mlp_weight_first=(1, None),
                               head_weight_first=(1, None))
        msinfer.layers.cpu_forms.cpu_matmul_forms = lambda: forms

    from msinfer import MsinferError, SamplingParams

    if args.model2:
        join_once_per_job()
    baseline = rss_bytes()
    try:
        llm = make_llm(args.model, args.strategy, args.graph_shapes, args.speculative_config)
    except MsinferError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    rank = llm.dist.rank
    after_load = rss_bytes()

    prompts = json.loads(args.prompts)
    if args.sampling:
        outs = llm.generate(prompts, [SamplingParams(**kwargs)
                                      for kwargs in json.loads(args.sampling)])
        with open(os.path.join(args.out, f"rank_{rank}.json"), "w") as f:
            json.dump([output_fields(out) for out in outs], f)
    else:
        write_results(llm, prompts, args, f"rank_{rank}.npz", baseline=baseline,
                      after_load=after_load)
    for number, path in enumerate(args.model2, start=2):
        strategies = args.model2_strategy[number - 2:number - 1] or [args.strategy]
        speculative = args.model2_speculative_config[number - 2:number - 1] or [None]
        counts = args.model2_new_tokens
        new_tokens = counts[0] if len(counts) == 1 else dict(enumerate(counts, 2)).get(number)
        other = make_llm(path, strategies[0], args.graph_shapes, speculative[0])
        write_results(other, prompts, args, f"rank_{rank}.model{number}.npz",
                      new_tokens=new_tokens)
    try:
        lose_a_rank(args.out, rank)
    except MsinferError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def join_once_per_job():
    """A process joins the job, and creates its tensor group, once: the second LLM of the job
    (--model2) takes what the first one made."""
    import msinfer.parallel.distributed as distributed

    made = {}
    init, group = distributed.init_distributed, distributed.tensor_group

    def init_distributed(*args, **kwargs):
        if "dist" not in made:
            made["dist"] = init(*args, **kwargs)
        return made["dist"]

    def tensor_group(info, shard_plan):
        key = (shard_plan.data, shard_plan.tensor)
        if key not in made:
            made[key] = group(info, shard_plan)
        return made[key]

    distributed.init_distributed = init_distributed
    distributed.tensor_group = tensor_group


def make_llm(model, strategy, graph_shapes, speculative=None):
    from msinfer import LLM

    return LLM(model, strategy=strategy, max_len=128, block_size=4, max_prefill_tokens=16,
               kv_cache_memory=1 << 20, graph_shapes=graph_shapes,
               speculative_config=speculative)


def write_results(llm, prompts, args, name, baseline=0, after_load=0, new_tokens=None):
    """Greedy tokens (new_tokens of them, default --new-tokens), the first 9 steps' log-probs
    of the whole vocabulary and this rank's memory figures of `llm` on `prompts`, to
    OUT/name."""
    from msinfer import SamplingParams

    vocab = llm.config.vocab_size
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens or args.new_tokens,
                                                temperature=0.0,
                                                ignore_eos=True, logprobs=vocab))
    logprobs = np.full((len(outs), 9, vocab), np.nan)
    for row, out in enumerate(outs):
        for step, found in enumerate(out.logprobs[:9]):
            logprobs[row, step, list(found)] = list(found.values())
    runner = llm.engine.runner
    weights = [runner.embed_weight] + [t for ws in runner.layer_weights for w in ws
                                       for t in (w if isinstance(w, tuple) else (w,))]
    weights += [w for w in runner.head_weights if w is not runner.embed_weight]
    param_bytes = sum(w.nbytes for w in weights)
    kv_bytes = runner.cache_bytes
    np.savez(os.path.join(args.out, name),
             tokens=np.array([out.token_ids for out in outs]),
             logprobs=logprobs,
             world_size=llm.dist.world_size,
             launcher=llm.dist.launcher,
             rss_baseline=baseline, rss_after_load=after_load,
             peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             param_bytes=param_bytes, kv_bytes=kv_bytes,
             spec=[getattr(llm.engine.stats(), f"spec_num_{n}")
                   for n in ("drafts", "draft_tokens", "accepted_tokens")])


def output_fields(out):
    """Every field of a RequestOutput as JSON writes it exactly (floats by repr); logprobs as
    [token id, logprob] pairs, since JSON keys are strings."""
    fields = dataclasses.asdict(out)
    del fields["scheduled_at"]  # a time of this rank's process: ranks differ in it
    if out.logprobs is not None:
        fields["logprobs"] = [sorted(step.items()) for step in out.logprobs]
    return fields


def lose_a_rank(out_dir, rank):
    """The test hooks: after a collective that every rank enters once its results are written,
    one rank dies or fails and the others wait for it in another collective."""
    from msinfer import MsinferError
    from msinfer.parallel.distributed import all_gather_rows

    kill = os.environ.get("MSINFER_TEST_KILL_RANK")
    fail = os.environ.get("MSINFER_TEST_FAIL_RANK")
    if kill is None and fail is None:
        return
    all_gather_rows(np.zeros((1, 1), np.float32))  # every rank's results are on disk
    if str(rank) in (kill, fail):
        with open(os.path.join(out_dir, "down_at"), "w") as f:
            f.write(repr(time.time()))
        if str(rank) == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        raise MsinferError(f"rank {rank}: injected failure (test hook)")
    print(f"rank {rank}: waiting in a collective for the lost rank", flush=True)
    all_gather_rows(np.zeros((1, 1), np.float32))  # never completes: one rank is gone
    open(os.path.join(out_dir, f"rank_{rank}.survived"), "w").close()


if __name__ == "__main__":
    code = main()
    if code == 0:
        # Every rank is done: leave together, skipping MindSpore's teardown, which can
        # segfault in a cluster thread (exit 139 in CI), as `msinfer` does. A rank that
        # fails alone exits at once: the others may be waiting for it, not in MPI's fence.
        from msinfer.parallel.distributed import leave_if_mpirun_rank
        leave_if_mpirun_rank(code)
    sys.exit(code)
