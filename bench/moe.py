"""A mixture-of-experts model against a dense model of the same active size, and against HF
transformers, decode time side by side in one process.

    python bench/moe.py [--out bench/results] [--quick]

Makes (if missing, under models/, git-ignored) two random checkpoints with `msinfer
make-tiny-model`: a Qwen3-MoE whose sparse layers route each token to 8 of 128 experts of
width 128 (Qwen3-30B-A3B's routing ratio), and a dense Qwen3 of the same shape whose MLP is
8 x 128 wide: the same parameters per token (the router's 128 x hidden aside). msinfer runs
both, and transformers the MoE, one after the other in this process on the same prompts
(greedy, ignore_eos), each warmed up first; per-token decode time is the engine's own decode
timing (msinfer) and (time of N tokens - time of 1 token) / (N - 1) (transformers), medians
of --reps runs, at batch 1 and 8. msinfer's MoE tokens are checked against transformers'.
Where g++ builds msinfer's C++ experts kernel (layers/moe.uses_cpu_kernel), the MoE also runs
without it (`moe_mindspore`: the MindSpore form that runs where g++ is missing), so the
kernel's gain is measured under the same load. Writes OUT/moe.json and OUT/moe.md with the
machine, its load and the versions.
"""
import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

from machine import machine_record, record_load_at_end  # noqa: E402

SHAPE = ["--family", "qwen3", "--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads",
         "4", "--head-dim", "64", "--vocab", "8192", "--seed", "5"]
MOE = ["--moe", "qwen3", "--experts", "128", "--top-k", "8", "--moe-intermediate", "128"]
DENSE = ["--intermediate", "1024"]  # 8 routed experts x 128
QUICK_MOE = ["--moe", "qwen3", "--experts", "16", "--top-k", "2", "--moe-intermediate", "64"]


def ensure_model(name, flags):
    path = os.path.join(ROOT, "models", name)
    if not os.path.isdir(path):
        subprocess.run([sys.executable, "-m", "msinfer", "make-tiny-model", path] + flags,
                       check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    return path


def msinfer_decode(llm, prompts, tokens):
    """Seconds per decode step (the engine's timing) and the greedy tokens."""
    from msinfer import SamplingParams

    timings = llm.engine.runner.timings
    steps, seconds = timings["decode_steps"], timings["decode_s"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                ignore_eos=True))
    step = (timings["decode_s"] - seconds) / (timings["decode_steps"] - steps)
    return step, [o.token_ids for o in outs]


@contextlib.contextmanager
def without_kernel():
    """Sparse layers built meanwhile take the MindSpore form, as where g++ is missing (the
    engine builds a graph's cells when a call first needs it)."""
    from msinfer.layers import moe as moe_layers

    with_kernel = moe_layers.uses_cpu_kernel
    moe_layers.uses_cpu_kernel = lambda device_target=None: False
    try:
        yield
    finally:
        moe_layers.uses_cpu_kernel = with_kernel


def kernels_in(llm):
    """Whether the sparse layers of each graph llm built run the kernel."""
    from msinfer.layers.moe import SparseMoE

    return {cell.kernel is not None for stack in llm.engine.runner.cells.values()
            for _, cell in stack.cells_and_names() if isinstance(cell, SparseMoE)}


def decode(name, llm, prompts, tokens):
    """msinfer_decode, the MoE's MindSpore form without the kernel."""
    if name != "moe_mindspore":
        return msinfer_decode(llm, prompts, tokens)
    with without_kernel():
        out = msinfer_decode(llm, prompts, tokens)
    assert kernels_in(llm) == {False}
    return out


def hf_decode(hf, prompts, tokens):
    """Seconds per decode step of transformers' generate (N tokens minus 1 token) and its
    greedy tokens."""
    import torch

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(n):
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()

    one, _ = run(1)
    full, out = run(tokens)
    return (full - one) / (tokens - 1), out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(BENCH, "results"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=33)
    p.add_argument("--quick", action="store_true", help="a small MoE: checks the harness only")
    args = p.parse_args(argv)
    machine = machine_record()
    moe_flags = QUICK_MOE if args.quick else MOE
    suffix = "-quick" if args.quick else ""
    moe_dir = ensure_model("bench-qwen3-moe" + suffix, SHAPE + moe_flags)
    dense_flags = ["--intermediate", "128"] if args.quick else DENSE
    dense_dir = ensure_model("bench-qwen3-dense" + suffix, SHAPE + dense_flags)

    import numpy as np
    import torch
    import transformers

    from msinfer import LLM
    from msinfer.config import ModelConfig
    from msinfer.layers import moe as moe_layers

    torch.set_num_threads(os.cpu_count())
    engine = dict(max_len=256, max_num_seqs=8, max_prefill_tokens=64)
    llms = {"moe": LLM(moe_dir, **engine), "dense": LLM(dense_dir, **engine)}
    if moe_layers.uses_cpu_kernel():
        llms["moe_mindspore"] = LLM(moe_dir, **engine)
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    results = {}
    for batch in (1, 8):
        prompts = rng.integers(0, 8192, size=(batch, 32)).tolist()
        for name, llm in llms.items():  # warm-up: compiles the graphs of this batch
            decode(name, llm, prompts, 4)
        assert kernels_in(llms["moe"]) == {moe_layers.uses_cpu_kernel()}
        hf_decode(hf, prompts, 3)
        runs = {name: [] for name in (*llms, "hf_moe")}
        for _ in range(args.reps):  # alternated, so a change of load weighs on all alike
            step, moe_tokens = msinfer_decode(llms["moe"], prompts, args.tokens)
            runs["moe"].append(step)
            runs["dense"].append(msinfer_decode(llms["dense"], prompts, args.tokens)[0])
            if "moe_mindspore" in llms:
                step, tokens = decode("moe_mindspore", llms["moe_mindspore"], prompts,
                                      args.tokens)
                runs["moe_mindspore"].append(step)
                assert tokens == moe_tokens, "the kernel and the MindSpore form differ"
            step, hf_tokens = hf_decode(hf, prompts, args.tokens)
            runs["hf_moe"].append(step)
            if moe_tokens != hf_tokens:
                raise SystemExit(f"batch {batch}: msinfer's MoE tokens differ from "
                                 f"transformers': {moe_tokens} vs {hf_tokens}")
        medians = {k: statistics.median(v) for k, v in runs.items()}
        results[f"batch{batch}"] = dict(
            decode_ms={k: round(v * 1000, 2) for k, v in medians.items()},
            runs_ms={k: [round(x * 1000, 2) for x in v] for k, v in runs.items()},
            moe_over_dense=round(medians["moe"] / medians["dense"], 3),
            moe_over_hf=round(medians["moe"] / medians["hf_moe"], 3),
            **({"moe_mindspore_over_dense": round(medians["moe_mindspore"] / medians["dense"], 3)}
               if "moe_mindspore" in medians else {}),
            same_tokens_as_hf=True)
        print(f"batch {batch}: {results[f'batch{batch}']}", flush=True)

    configs = {k: ModelConfig.from_model_dir(d) for k, d in (("moe", moe_dir),
                                                             ("dense", dense_dir))}
    record = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        quick=args.quick, reps=args.reps, new_tokens=args.tokens,
        prompt_tokens=32, engine=engine,
        models={k: dict(flags=SHAPE + (moe_flags if k == "moe" else dense_flags),
                        parameters=c.num_parameters(),
                        active_parameters=c.num_active_parameters())
                for k, c in configs.items()},
        machine=record_load_at_end(machine),
        versions=dict(torch=torch.__version__, transformers=transformers.__version__),
        results=results)
    os.makedirs(args.out, exist_ok=True)
    name = "moe_quick" if args.quick else "moe"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(markdown(record))
    print(markdown(record))


def markdown(r):
    m, d = r["models"]["moe"], r["models"]["dense"]
    lines = [
        "# MoE against dense of the same active size, and against transformers",
        "",
        f"`python bench/moe.py` at {r['machine']['commit']}, {r['date']}; "
        f"{r['machine']['cpu']}, {r['machine']['cores']} cores, load average "
        f"{r['machine']['load_average_at_start']} at the start, "
        f"{r['machine']['load_average_at_end']} at the end; "
        f"MindSpore {r['machine']['mindspore']}, torch {r['versions']['torch']}, "
        f"transformers {r['versions']['transformers']}.",
        "",
        *([f"**Measured under load** (a load average above the {r['machine']['cores']} cores: "
           "other jobs shared the host), so the steps are slower and noisier than on a quiet "
           "host; the runs of each column are in moe.json.", ""]
          if max(r["machine"]["load_average_at_start"][0],
                 r["machine"]["load_average_at_end"][0]) > r["machine"]["cores"] else []),
        f"- MoE: Qwen3-MoE, `{' '.join(m['flags'])}`: {m['parameters']:,} parameters, "
        f"{m['active_parameters']:,} active per token",
        f"- dense: Qwen3, `{' '.join(d['flags'])}`: {d['parameters']:,} parameters",
        f"- {r['prompt_tokens']}-token prompts, {r['new_tokens']} greedy tokens, median of "
        f"{r['reps']} runs alternated in one process; float32; msinfer's tokens equal "
        f"transformers' on the MoE",
        "",
        "| batch | msinfer MoE ms/step | msinfer dense ms/step | transformers MoE ms/step "
        "| MoE / dense | MoE / transformers |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in r["results"].items():
        ms = row["decode_ms"]
        lines.append(f"| {key[5:]} | {ms['moe']} | {ms['dense']} | {ms['hf_moe']} | "
                     f"{row['moe_over_dense']}x | {row['moe_over_hf']}x |")
    if all("moe_mindspore" in row["decode_ms"] for row in r["results"].values()):
        lines += ["", "The MoE above runs its experts as msinfer's C++ kernel; without it (the "
                  "MindSpore form, where g++ is missing), in the same runs:", "",
                  "| batch | msinfer MoE, MindSpore form ms/step | its / dense |", "|---|---|---|"]
        lines += [f"| {key[5:]} | {row['decode_ms']['moe_mindspore']} | "
                  f"{row['moe_mindspore_over_dense']}x |" for key, row in r["results"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
