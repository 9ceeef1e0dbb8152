"""What logprobs=5 costs a decode step, at batch 1 and 16, with Qwen's 151,936-token
vocabulary (issue 38: it was 1.40x, 27.6 vs 19.7 ms a batch-16 step; the goal <= 1.2x).

    python bench/logprobs_step.py            # bench/results/logprobs_step.json, .md
    python bench/logprobs_step.py --quick    # fewer steps: checks the script

Two measurements, each side by side in one process, the two sides taking turns:
- host: LLMEngine steps over a stub runner that returns fixed logits rows (no graphs), so
  only the host's work is timed: scheduling, sampling, logprobs, stop checks, outputs;
- model: LLM steps of a random checkpoint with the 151,936-token vocabulary (2 layers,
  hidden 256, made once in models/), greedy, no prefix cache: a step whose graphs take
  about as long as the issue's 19.7 ms on a fast machine;
- score: the same model scoring 16 prompts of 32 tokens as lm-evaluation-harness does
  (max_tokens 1, prompt logprobs 1: every prompt position's row through the lm_head and the
  host) against the same prompts plainly (issue 21's "echo" question).
Each comparison runs `pairs` pairs of runs, one run per side, the order alternating (plain
first in even pairs, logprobs first in odd ones) after one pair that warms both up: a run's
figure is the median of its steps, a pair's ratio is its logprobs run over its plain run, and
what is reported is the median of the pairs' ratios (with its quartiles) and the median of
each side's runs. A burst of another process's load skews the pair it lands in, not the
figure. The CPU and the load average (at the start and end of each part) go with them.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import machine_record, record_load_at_end  # noqa: E402
from run import ensure_model  # noqa: E402

VOCAB = 151936
TOP = 5
MODEL = ("qwen2-151936-vocab-2l", ["--layers", "2", "--hidden", "256", "--heads", "4",
                                   "--kv-heads", "2", "--vocab", str(VOCAB), "--tie"])


class StubRunner:
    """Logits rows drawn once (random, scaled like a model's), the same every step."""

    def __init__(self, batch):
        self.rows = (np.random.default_rng(0).standard_normal((batch, VOCAB)) * 3
                     ).astype(np.float32)

    def decode(self, seqs):
        return self.rows[:len(seqs)].copy()  # a runner hands out a fresh array each call

    def prefill(self, chunks):
        return self.rows[:sum(len(c.logit_positions()) for c in chunks)].copy()


def stub_engine(batch):
    from msinfer.engine import LLMEngine
    from msinfer.config import ModelConfig
    from msinfer.engine_config import EngineConfig, EngineLimits
    from msinfer.planning.kv_layout import CacheLayout
    layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=4, block_size=16,
                         num_blocks=batch * 64 + 2, dtype_bytes=4)
    limits = EngineLimits(max_model_len=1024, max_num_seqs=batch, max_prefill_tokens=256)
    model = ModelConfig(vocab_size=VOCAB, hidden_size=4, intermediate_size=4, num_layers=1,
                        num_heads=1, num_kv_heads=1, head_dim=4)  # only its vocabulary is read
    config = EngineConfig(model="<stub>", model_config=model, limits=limits)
    return LLMEngine(StubRunner(batch), layout, config, eos_token_ids=[], seed=0)


def timed_steps(engine, batch, logprobs, steps, prefix):
    """Median seconds of `steps` decode steps of `batch` greedy requests (logprobs or not),
    once every request is decoding; the requests are then aborted."""
    from msinfer import SamplingParams
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True,
                            logprobs=logprobs)
    ids = [f"{prefix}{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [1 + i, 2, 3, 4], params)
    started = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.token_ids}
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return statistics.median(times)


def paired(run_side, sides, pairs):
    """Run `sides` (two names) `pairs` times each, in alternating order, after one pair of
    warm-up runs: {"plain_ms", "logprobs_ms": medians of each side's runs, "ratio": median of
    the pairs' ratios (second side over first), "ratio_q1", "ratio_q3", "added_ms", "pairs"}.
    run_side(name, pair) gives one run's seconds."""
    first, second = sides
    for name in sides:
        run_side(name, -1)
    runs = {first: [], second: []}
    ratios = []
    for pair in range(pairs):
        order = sides if pair % 2 == 0 else sides[::-1]
        seconds = {name: run_side(name, pair) for name in order}
        for name in sides:
            runs[name].append(seconds[name])
        ratios.append(seconds[second] / seconds[first])
    q1, _, q3 = (statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1
                 else ratios * 3)
    plain, scored = statistics.median(runs[first]), statistics.median(runs[second])
    return {"plain_ms": plain * 1e3, "logprobs_ms": scored * 1e3,
            "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
            "added_ms": (scored - plain) * 1e3, "pairs": pairs,
            "load_average_after": os.getloadavg()[0]}


def compare(engine, batch, steps, pairs):
    """Decode steps of `batch` requests without and with logprobs, paired runs."""
    def run_side(top, pair):
        return timed_steps(engine, batch, top, steps if pair >= 0 else 4, f"{pair}-{top}-")
    return paired(run_side, (None, TOP), pairs)


def compare_scoring(llm, pairs, batch=16, length=32):
    """Seconds to generate 1 token for `batch` prompts, plainly and with prompt logprobs
    (and logprobs 1, as lm-eval asks), paired runs."""
    from msinfer import SamplingParams
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, length).tolist() for _ in range(batch)]
    sides = {"plain": SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
             "prompt_logprobs": SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                                               logprobs=1, prompt_logprobs=1)}

    def run_side(name, pair):
        start = time.perf_counter()
        llm.generate(prompts, sides[name])
        return time.perf_counter() - start
    return paired(run_side, tuple(sides), pairs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "logprobs_step"))
    p.add_argument("--note", default="", help="what the results' table says of the run "
                   "(e.g. what else ran on the machine)")
    args = p.parse_args()
    steps, pairs = (8, 2) if args.quick else (96, 11)
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": machine_record(), "vocab": VOCAB, "top": TOP, "steps": steps,
               "pairs": pairs, "note": args.note, "host": {}, "model": {}, "score": {}}
    for batch in (1, 16):
        results["host"][batch] = compare(stub_engine(batch), batch, steps, pairs)
        print(f"host  batch {batch}: {results['host'][batch]}", flush=True)
    from msinfer import LLM
    model_dir = ensure_model(*MODEL, print)
    results["model_dir"] = os.path.relpath(model_dir, ROOT)
    for batch in (1, 16):
        llm = LLM(model_dir, max_len=128, max_num_seqs=batch, enable_prefix_caching=False,
                  max_prefill_tokens=256)
        llm.engine.warmup()
        results["model"][batch] = compare(llm.engine, batch, steps, pairs)
        print(f"model batch {batch}: {results['model'][batch]}", flush=True)
        if batch == 16:
            results["score"][batch] = compare_scoring(llm, pairs)
            print(f"score batch {batch}: {results['score'][batch]}", flush=True)
        del llm
    record_load_at_end(results["machine"])
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table(results))
    print(table(results))


def table(results):
    m = results["machine"]
    lines = [f"logprobs={results['top']} vs none, per decode step, vocabulary "
             f"{results['vocab']}: {m['cpu']}, {m['cores']} cores, load average "
             f"{m['load_average_at_start'][0]:.2f} at the start, "
             f"{m['load_average_at_end'][0]:.2f} at the end ({results['date']}).",
             "", *([results["note"], ""] if results.get("note") else []),
             f"host, model: one decode step ({results['steps']} steps a run); score: 16 "
             f"prompts of 32 tokens scored (prompt logprobs 1, max_tokens 1) or not. "
             f"{results['pairs']} pairs of runs, the sides' order alternating: medians of "
             f"the runs, the median of the pairs' ratios and its quartiles.",
             "",
             "| part | batch | plain ms | logprobs ms | ratio (median of pairs) | quartiles "
             "| added ms | load after |",
             "|---|---|---|---|---|---|---|---|"]
    for part in ("host", "model", "score"):
        for batch, r in results.get(part, {}).items():
            lines.append(f"| {part} | {batch} | {r['plain_ms']:.2f} | {r['logprobs_ms']:.2f} "
                         f"| **{r['ratio']:.2f}** | {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} "
                         f"| {r['added_ms']:.2f} | {r['load_average_after']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
