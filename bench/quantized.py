"""Quantized checkpoints against the float model, side by side in one run (issue 36): the
resident weight memory and the batch-1 / batch-16 decode speed of Qwen2-0.5B's shape, float
vs msModelSlim's W8A8 vs W8A16, each side in a process of its own.

    python bench/quantized.py [--out bench/results] [--reps 3]

The source is a random Qwen2-0.5B-shaped checkpoint (models/qwen2-0.5b-shape-bf16, made by
`msinfer make-tiny-model`), quantized here by msModelSlim's own command line (v1 layout,
per-channel int8 weights; W8A8 with static per-tensor activations calibrated on five
sentences); all three run in float32 on CPU. Writes OUT/quantized.json (every figure, the
machine, its load) and OUT/quantized.md (the table).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

MODELS = os.path.join(ROOT, "models")
SOURCE = "qwen2-0.5b-shape-bf16"
CALIBRATION = ["The quick brown fox jumps over the lazy dog near the river bank.",
               "A language model predicts the next word from the words before it.",
               "Servers with inference cards run quantized weights to save memory.",
               "In the morning the market opens and traders watch the prices move.",
               "Mathematics is the study of numbers, shapes and patterns of change."]
ACT = "        act:    {scope: per_tensor,  dtype: int8, symmetric: False, method: minmax}\n"
V1 = """apiversion: modelslim_v1
metadata: {{config_id: bench, label: {{w_bit: 8, a_bit: {a_bit}, is_sparse: False, kv_cache: False}}}}
spec:
  process:
    - type: linear_quant
      qconfig:
{act}        weight: {{scope: per_channel, dtype: int8, symmetric: True,  method: minmax}}
      include: ["*"]
  runner: model_wise
  dataset: {dataset}
  save: [{{type: ascendv1_saver, part_file_size: 4}}]
"""
SIDES = {"float": SOURCE, "W8A8": "qwen2-0.5b-shape-w8a8", "W8A16": "qwen2-0.5b-shape-w8a16"}
PROMPT_LEN, DECODE = 16, {1: 64, 16: 32}


def ensure_models(log):
    source = os.path.join(MODELS, SOURCE)
    if not os.path.isfile(os.path.join(source, "config.json")):
        log(f"making {source}")
        subprocess.run([sys.executable, "-m", "msinfer", "make-tiny-model", source, "--preset",
                        "qwen2-0.5b-shape", "--dtype", "bfloat16"], check=True, cwd=ROOT)
    dataset = os.path.join(MODELS, "calib.jsonl")
    with open(dataset, "w") as f:
        f.writelines(json.dumps({"inputs_pretokenized": s}) + "\n" for s in CALIBRATION)
    for scheme, a_bit, act in (("W8A8", 8, ACT), ("W8A16", 16, "")):
        out = os.path.join(MODELS, SIDES[scheme])
        if os.path.isfile(os.path.join(out, "quant_model_description.json")):
            continue
        config = os.path.join(MODELS, f"bench-{scheme.lower()}.yaml")
        with open(config, "w") as f:
            f.write(V1.format(a_bit=a_bit, act=act, dataset=dataset))
        log(f"quantizing {source} to {scheme} with msModelSlim")
        subprocess.run([sys.executable, "-m", "msmodelslim.cli", "quant", "--model_type",
                        "Qwen2-7B", "--model_path", source, "--save_path", out, "--device",
                        "cpu", "--config_path", config], check=True, cwd=MODELS)


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def side(model_dir, reps):
    """One side, in this process: its weight bytes, RSS, and decode tokens/s per batch."""
    import numpy as np

    from msinfer import LLM, SamplingParams

    before = rss_bytes()
    llm = LLM(model_dir, max_len=256, max_num_seqs=16, max_prefill_tokens=256)
    after = rss_bytes()
    runner = llm.engine.runner
    tensors = [runner.embed_weight] + [t for layer in runner.layer_weights for w in layer
                                       for t in (w if isinstance(w, tuple) else (w,))]
    tensors += [w for w in runner.head_weights if w is not runner.embed_weight]
    by_dtype = {}
    for t in tensors:
        by_dtype[str(t.dtype)] = by_dtype.get(str(t.dtype), 0) + t.nbytes
    rng = np.random.default_rng(0)
    result = {"weight_bytes": sum(by_dtype.values()), "weight_bytes_by_dtype": by_dtype,
              "rss_after_load_bytes": after, "rss_load_growth_bytes": after - before,
              "decode_tokens_per_s": {}, "decode_runs_s": {}}
    for batch, new in DECODE.items():
        prompts = [rng.integers(0, 150000, PROMPT_LEN).tolist() for _ in range(batch)]

        def run(tokens):
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                 ignore_eos=True))
            return time.perf_counter() - start
        run(new)  # compiles this batch's graphs
        # decode time: a run of `new` tokens less a run of 1 (the prefill and first token)
        runs = [run(new) - run(1) for _ in range(reps)]
        result["decode_runs_s"][batch] = runs
        result["decode_tokens_per_s"][batch] = batch * (new - 1) / statistics.median(runs)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def table(results):
    float_side = results["sides"]["float"]
    lines = ["| | float32 | W8A8 | W8A16 |", "|---|---|---|---|"]

    def row(label, get, fmt):
        cells = [fmt(get(results["sides"][s]), get(float_side)) for s in SIDES]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    gib = 1 << 30
    row("resident weights", lambda r: r["weight_bytes"],
        lambda v, f: f"{v / gib:.2f} GiB ({v / f:.2f}x)")
    row("  of which int8", lambda r: r["weight_bytes_by_dtype"].get("Int8", 0),
        lambda v, f: f"{v / gib:.2f} GiB")
    row("RSS after load", lambda r: r["rss_after_load_bytes"],
        lambda v, f: f"{v / gib:.2f} GiB ({v / f:.2f}x)")
    for batch in DECODE:
        row(f"decode, batch {batch}", lambda r, b=batch: r["decode_tokens_per_s"][str(b)],
            lambda v, f: f"{v:.1f} tok/s ({v / f:.2f}x)")
    m = results["machine"]
    lines += ["", f"{m['cpu']}, {m['cores']} cores; load average {m['load_average_at_start']} "
              f"at the start, {m['load_average_at_end']} at the end; git {m['commit']}"]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(BENCH, "results"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--side", help=argparse.SUPPRESS)  # a worker: one model directory
    args = p.parse_args()
    if args.side:
        print("RESULT " + json.dumps(side(args.side, args.reps)), flush=True)
        return 0

    def log(message):
        print(f"[bench] {message}", file=sys.stderr, flush=True)
    ensure_models(log)
    from machine import machine_record, record_load_at_end  # (bench/machine.py)
    machine = machine_record()
    sides = {}
    for name, directory in SIDES.items():
        log(f"{name}: {directory}")
        done = subprocess.run([sys.executable, __file__, "--side",
                               os.path.join(MODELS, directory), "--reps", str(args.reps)],
                              capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT, GLOG_v="3"))
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
        sides[name] = json.loads(lines[-1][len("RESULT "):])
    results = {"machine": record_load_at_end(machine), "prompt_len": PROMPT_LEN,
               "decode_tokens": DECODE, "reps": args.reps, "sides": sides}
    results = json.loads(json.dumps(results))  # int keys as JSON has them
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quantized.json"), "w") as f:
        json.dump(results, f, indent=2)
    text = table(results)
    with open(os.path.join(args.out, "quantized.md"), "w") as f:
        f.write("# Quantized vs float, Qwen2-0.5B's shape (bench/quantized.py)\n\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
