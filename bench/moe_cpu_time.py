"""CPU time per decode step of bench/moe.py's models on one thread: the MoE with msinfer's C++
experts kernel, the MoE without it (the MindSpore form) and the dense model of the same active
size. On a shared host the load stretches wall time by 2-4x from run to run; the CPU time a
single-threaded process spends per step moves far less, so this compares the forms' cost
where bench/moe.py's wall times cannot.

    MSINFER_CPU_THREADS=1 python bench/moe_cpu_time.py [--out bench/results]

Per step: (CPU time of 33 greedy tokens - of 1 token) / 32 (time.process_time), medians of
--reps runs alternated, batch 1 and 8. Writes OUT/moe_cpu_time.json and .md.
"""
import argparse
import json
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import moe as bench  # noqa: E402
from machine import machine_record, record_load_at_end  # noqa: E402


def cpu_ms_per_step(name, llm, prompts, tokens):
    from msinfer import SamplingParams

    def run(n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.process_time()
        if name == "moe_mindspore":
            with bench.without_kernel():
                llm.generate(prompts, params)
        else:
            llm.generate(prompts, params)
        return time.process_time() - start

    one = run(1)
    return (run(tokens) - one) / (tokens - 1) * 1000


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(BENCH, "results"))
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if os.environ.get("MSINFER_CPU_THREADS") != "1":
        raise SystemExit("run with MSINFER_CPU_THREADS=1: CPU time is the cost on one thread")
    import numpy as np

    from msinfer import LLM

    moe_dir = bench.ensure_model("bench-qwen3-moe", bench.SHAPE + bench.MOE)
    dense_dir = bench.ensure_model("bench-qwen3-dense", bench.SHAPE + bench.DENSE)
    engine = dict(max_len=256, max_num_seqs=8, max_prefill_tokens=64)
    llms = {"moe": LLM(moe_dir, **engine), "dense": LLM(dense_dir, **engine),
            "moe_mindspore": LLM(moe_dir, **engine)}
    machine = machine_record()
    rng = np.random.default_rng(0)
    results = {}
    for batch in (1, 8):
        prompts = rng.integers(0, 8192, size=(batch, 32)).tolist()
        for name, llm in llms.items():  # warm-up: compiles the graphs of this batch
            cpu_ms_per_step(name, llm, prompts, 4)
        assert bench.kernels_in(llms["moe"]) == {True}
        assert bench.kernels_in(llms["moe_mindspore"]) == {False}
        runs = {name: [] for name in llms}
        for _ in range(args.reps):
            for name, llm in llms.items():
                runs[name].append(round(cpu_ms_per_step(name, llm, prompts, 33), 2))
        medians = {k: statistics.median(v) for k, v in runs.items()}
        results[f"batch{batch}"] = dict(
            cpu_ms_per_step={k: round(v, 2) for k, v in medians.items()}, runs=runs,
            moe_over_dense=round(medians["moe"] / medians["dense"], 3),
            moe_mindspore_over_dense=round(medians["moe_mindspore"] / medians["dense"], 3))
        print(f"batch {batch}: {results[f'batch{batch}']}", flush=True)
    record = dict(machine=record_load_at_end(machine), reps=args.reps, results=results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_cpu_time.json"), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    lines = ["# CPU time per decode step on one thread: MoE (kernel, MindSpore form) and dense",
             "", f"`MSINFER_CPU_THREADS=1 python bench/moe_cpu_time.py`: bench/moe.py's models, "
             f"{machine['cores']} cores, load average {machine['load_average_at_start']} at the "
             f"start, {machine['load_average_at_end']} at the end; medians of {args.reps} runs "
             "alternated.", "",
             "| batch | MoE (kernel) | MoE, MindSpore form | dense | MoE / dense | "
             "MindSpore form / dense |", "|---|---|---|---|---|---|"]
    for key, row in results.items():
        ms = row["cpu_ms_per_step"]
        lines.append(f"| {key[5:]} | {ms['moe']} ms | {ms['moe_mindspore']} ms | {ms['dense']} ms"
                     f" | {row['moe_over_dense']}x | {row['moe_mindspore_over_dense']}x |")
    with open(os.path.join(args.out, "moe_cpu_time.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
