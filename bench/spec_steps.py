"""Where a speculative step's time goes, against plain decoding: one process, one LLM per
method, the bench's models and workloads (bench/speculative.py, bench/spec_workloads.py);
each engine step timed in parts, plain (speculation set aside) and speculative runs
alternated.

    python bench/spec_steps.py [--methods ngram,suffix,draft_model] [--workload no_repeat]
                               [--batch 1] [--reps 3]

Parts of a step: schedule (the scheduler, with the proposal budget), propose (the proposer;
a draft model's own calls are `draft calls`, inside it), model (the target's calls: a plain
step's decode call, a verifying step's prefill call), decide (sampling, verification,
appending, stop checks), other (the rest of the engine step and of LLM.generate). Steps are
counted by kind: 'decode' (plain), 'verify' (a verification in the step). Prints ms per
step of each part, and per kind of step the model call's ms.
"""
import argparse
import collections
import functools
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import speculative as bench  # noqa: E402
from machine import machine_record  # noqa: E402


class StepClock:
    """Accumulates seconds by part and by kind of step, wrapping the engine's methods."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.model_by_kind = collections.defaultdict(list)
        self.steps = collections.Counter()
        self.verify_rows = collections.Counter()  # tokens of a verifying call: how many
        self._kind = None

    def wrap(self, owner, name, part):
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.seconds[part] += spent
                if part == "draft calls":
                    self.model_by_kind["draft " + name].append(spent)
                if part == "model":
                    verifies = name == "prefill" and any(c.proposal for c in args[0])
                    self.model_by_kind["verify" if verifies else name].append(spent)
                    if verifies:
                        self.verify_rows[sum(c.count for c in args[0])] += 1
        setattr(owner, name, timed)

    def instrument(self, engine):
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.runner, "decode", "model")
        self.wrap(engine.runner, "prefill", "model")
        for name in ("_sample", "_postprocess", "_verify", "_drop_unsampled"):
            self.wrap(engine, name, "decide")
        if engine.speculation is not None:
            proposer = engine.speculation.proposer
            self.wrap(proposer, "propose", "propose")
            draft = getattr(proposer, "runner", None)
            if draft is not None:
                self.wrap(draft, "decode", "draft calls")
                self.wrap(draft, "prefill", "draft calls")
        step = engine.step

        def counted():
            start = time.perf_counter()
            outputs = step()
            self.seconds["step"] += time.perf_counter() - start
            verified = any(isinstance(d[1], list) for d in engine.decisions)
            self.steps["verify" if verified else "decode"] += 1
            return outputs
        engine.step = counted

    def reset(self):
        self.__init__()

    def report(self, wall, tokens):
        steps = sum(self.steps.values())
        parts = ["schedule", "propose", "draft calls", "model", "decide"]
        out = {p: 1e3 * self.seconds[p] / steps for p in parts}
        out["other"] = 1e3 * (wall - sum(self.seconds[p] for p in parts
                                         if p != "draft calls")) / steps
        out["steps"] = dict(self.steps)
        out["verify call tokens"] = dict(sorted(self.verify_rows.items()))
        out["tokens"] = tokens
        out["ms/token"] = 1e3 * wall / tokens
        out["model calls (count, median ms)"] = {
            k: (len(v), round(1e3 * statistics.median(v), 1))
            for k, v in self.model_by_kind.items()}
        return out


def run(llm, workload, clock):
    clock.reset()
    start = time.perf_counter()
    tps, outputs = bench.run_workload(llm, workload)
    wall = time.perf_counter() - start
    return clock.report(wall, sum(len(o) for o in outputs)), outputs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ngram,suffix,draft_model")
    p.add_argument("--workload", default="no_repeat")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    print("machine", machine_record(), flush=True)
    target = bench.ensure_model("bench-copying-target", bench.TARGET_SHAPE)
    draft = bench.ensure_model("bench-copying-draft", {})
    from msinfer import LLM
    from spec_workloads import special_tokens, spec_workloads

    specials = special_tokens(target)
    for method in args.methods.split(","):
        settings = dict(bench.METHODS[method])
        if method == "draft_model":
            settings["model"] = draft
        llm = LLM(target, **bench.ENGINE, speculative_config=settings)
        llm.warmup()
        clock = StepClock()
        clock.instrument(llm.engine)
        speculation = llm.engine.speculation

        def workload(seed):
            return next(w for w in spec_workloads(
                llm.config.vocab_size, specials["<|im_start|>"], avoid=specials.values(),
                rounds=1, seed=seed) if w.name == args.workload and w.batch_size == args.batch)

        bench.run_workload(llm, workload(1000))  # first pass: allocator, graphs
        reports = {"off": [], "on": []}
        for rep in range(args.reps):
            w = workload(rep)
            llm.engine.speculation = None
            off, plain = run(llm, w, clock)
            llm.engine.speculation = speculation
            on, spec = run(llm, w, clock)
            assert plain == spec, "speculation changed the greedy tokens"
            reports["off"].append(off)
            reports["on"].append(on)
        print(f"== {method} {args.workload} batch {args.batch} (load "
              f"{os.getloadavg()[0]:.2f})")
        for side, runs in reports.items():
            best = sorted(runs, key=lambda r: r["ms/token"])[len(runs) // 2]
            print(f"  {side:3}: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in best.items()), flush=True)
        ratio = (statistics.median(r["ms/token"] for r in reports["off"])
                 / statistics.median(r["ms/token"] for r in reports["on"]))
        print(f"  on/off tokens/s: {ratio:.3f}", flush=True)
        del llm


if __name__ == "__main__":
    main()
