"""What the model-free proposers (engine/speculative/ngram.py, suffix.py) cost the host per
decode step, for one sequence of 1k, 4k and 16k tokens: the step's cost must not grow with the
sequence (each keeps per-sequence state extended by the new tokens only).

    python bench/proposers.py            # bench/results/proposers.json, .txt (~1 minute)
    python bench/proposers.py --quick    # 1k and 4k only, fewer steps

Two texts: "random" (tokens drawn from 32,000: next to no repeats, the most tree nodes) and
"grounded" (a random prompt, then an output that copies spans of it with a few other tokens
between: proposals mostly right). Each step appends what a verification would emit (the
accepted proposal and one more token, 1 to k + 1 tokens) and times propose() alone. First call:
the prompt indexed at once. Memory: what tracemalloc sees allocated for the state.
"""
import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import machine_record, record_load_at_end  # noqa: E402

from msinfer.engine.sampling import SamplingParams  # noqa: E402
from msinfer.engine.sequence import Sequence  # noqa: E402
from msinfer.engine.speculative import build_proposer  # noqa: E402
from msinfer.speculative_config import SpeculativeConfig  # noqa: E402

K = 4
VOCAB = 32000


def text(kind, prompt_len, steps, rng):
    """(prompt, the tokens the output will emit)."""
    prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
    out = []
    while len(out) < steps * (K + 1):
        if kind == "random":
            out.append(rng.randrange(VOCAB))
        else:
            start = rng.randrange(prompt_len - 64)
            out.extend(prompt[start:start + rng.randint(20, 60)])
            out.extend(rng.randrange(VOCAB) for _ in range(rng.randint(1, 3)))
    return prompt, out


def run(method, kind, prompt_len, steps, rng):
    config = SpeculativeConfig(method=method, num_speculative_tokens=K)
    proposer = build_proposer(config)
    prompt, future = text(kind, prompt_len, steps, rng)
    seq = Sequence("r", prompt, SamplingParams())
    seq.generated.append(future[0])
    t0 = time.perf_counter()
    proposal = proposer.propose([seq], [K])[0]
    first = time.perf_counter() - t0
    times, proposed, accepted = [], 0, 0
    at = 1
    for _ in range(steps):
        # what a verification emits: the proposal's agreeing prefix and one more token
        n = 0
        while n < len(proposal) and proposal[n] == future[at + n]:
            n += 1
        proposed += len(proposal)
        accepted += n
        seq.generated.extend(future[at:at + n + 1])
        at += n + 1
        t0 = time.perf_counter()
        proposal = proposer.propose([seq], [K])[0]
        times.append(time.perf_counter() - t0)
    return {"method": method, "text": kind, "prompt_tokens": prompt_len,
            "tokens_at_end": seq.length, "first_call_ms": round(first * 1e3, 2),
            "step_us_median": round(statistics.median(times) * 1e6, 1),
            "step_us_p90": round(sorted(times)[int(0.9 * len(times))] * 1e6, 1),
            "acceptance": round(accepted / proposed, 3) if proposed else None}


def state_bytes(method, kind, prompt_len, rng):
    """Bytes allocated by the proposer for one sequence of prompt_len + 1 tokens."""
    proposer = build_proposer(SpeculativeConfig(method=method, num_speculative_tokens=K))
    prompt, future = text(kind, prompt_len, 1, rng)
    seq = Sequence("r", prompt, SamplingParams())
    seq.generated.append(future[0])
    tracemalloc.start()
    proposer.propose([seq], [K])
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return size


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    lengths = (1024, 4096) if args.quick else (1024, 4096, 16384)
    steps = 50 if args.quick else 300
    rng = random.Random(0)
    machine = machine_record()
    rows = []
    for method in ("ngram", "suffix"):
        for kind in ("random", "grounded"):
            for n in lengths:
                row = run(method, kind, n, steps, rng)
                row["state_kib"] = round(state_bytes(method, kind, n, rng) / 1024)
                rows.append(row)
                print(row, flush=True)
    result = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": record_load_at_end(machine), "k": K,
              "rows": rows}
    header = (f"{'method':7} {'text':9} {'prompt':>6} {'first call ms':>13} "
              f"{'step us (median)':>16} {'p90':>7} {'state KiB':>9} {'accepted':>8}")
    lines = [header] + [
        f"{r['method']:7} {r['text']:9} {r['prompt_tokens']:>6} {r['first_call_ms']:>13} "
        f"{r['step_us_median']:>16} {r['step_us_p90']:>7} {r['state_kib']:>9} "
        f"{r['acceptance'] if r['acceptance'] is not None else '-':>8}" for r in rows]
    lines.append(f"{machine['cpu']}, {machine['cores']} cores, load average "
                 f"{machine['load_average_at_start'][0]:.1f} at the start, "
                 f"{machine['load_average_at_end'][0]:.1f} at the end; {result['when']}; k={K}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "proposers.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "proposers.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
