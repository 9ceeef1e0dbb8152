"""One rank of a multi-process test job (started by tests/test_distributed.py under mpirun or
msrun). Runs greedy generation on a batch of prompts, records the logits of the prefill and
the first decode steps, and writes them with this rank's memory figures to OUT/rank_R.npz.

Test hooks: MSINFER_TEST_KILL_RANK=r makes rank r SIGKILL itself after loading;
MSINFER_TEST_FAIL_RANK=r makes rank r raise a user error (as a bad file would) after init;
--weight-first computes every MLP and lm_head product as (W @ x.T).T, whatever this
processor's forms (hardware.cpu_matmul_forms), so that the sharded lm_head's transposed
gather runs.
"""
import argparse
import json
import os
import resource
import signal
import sys

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
    p.add_argument("--weight-first", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("GLOG_v", "3")
    if args.weight_first:
        import msinfer.layers.cpu_forms
        from msinfer.hardware import CpuMatmulForms

        forms = CpuMatmulForms(in_out=False, mlp_weight_first=(1, None),
                               head_weight_first=(1, None))
        msinfer.layers.cpu_forms.cpu_matmul_forms = lambda: forms

    from msinfer import LLM, MsinferError, SamplingParams

    baseline = rss_bytes()
    try:
        llm = LLM(args.model, strategy=args.strategy, max_len=128, block_size=4,
                  max_prefill_tokens=16, kv_cache_memory=1 << 20)
        rank = llm.dist.rank
        if os.environ.get("MSINFER_TEST_FAIL_RANK") == str(rank):
            raise MsinferError(f"rank {rank}: injected failure (test hook)")
    except MsinferError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    after_load = rss_bytes()
    if os.environ.get("MSINFER_TEST_KILL_RANK") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)

    prompts = json.loads(args.prompts)
    vocab = llm.config.vocab_size
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.new_tokens, temperature=0.0,
                                                ignore_eos=True, logprobs=vocab))
    logprobs = np.full((len(outs), 9, vocab), np.nan)
    for row, out in enumerate(outs):
        for step, found in enumerate(out.logprobs[:9]):
            logprobs[row, step, list(found)] = list(found.values())
    runner = llm.engine.runner
    weights = [runner.embed_weight] + [w for ws in runner.layer_weights for w in ws]
    weights += [w for w in runner.head_weights if w is not runner.embed_weight]
    param_bytes = sum(w.nbytes for w in weights)
    kv_bytes = runner.cache_bytes
    np.savez(os.path.join(args.out, f"rank_{rank}.npz"),
             tokens=np.array([out.token_ids for out in outs]),
             logprobs=logprobs,
             world_size=llm.dist.world_size,
             launcher=llm.dist.launcher,
             rss_baseline=baseline, rss_after_load=after_load,
             peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             param_bytes=param_bytes, kv_bytes=kv_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
