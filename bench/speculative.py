"""Speculative decoding on vs off, side by side in one process: output tokens/s of each method
(ngram, suffix, draft_model) on an input-grounded workload (answers copy spans of the prompt)
and on one with no repeats, at batch 1 and batch 8, with acceptance rates.

    python bench/speculative.py [--out bench/results] [--reps 3] [--quick]

Makes (if missing, under models/, git-ignored) a copying target and a copying draft with
`msinfer make-tiny-model --copying` (msinfer/tools/copying_model.py: an induction circuit in
the weights, so proposals drawn from the prompt are accepted as on real grounded text; random
tiny checkpoints never copy): the target TARGET_SHAPE (about 170M parameters: its decode step
reads its weights, as a real model's does), the draft the 2-layer COPYING_SHAPE (about 2M). Each method runs in its own LLM; "off" is the same LLM with its speculation set aside,
so both use the same compiled graphs. Runs alternate off/on (a change of load weighs on both
alike); each figure is the median of --reps runs. Batch 1 sends one request at a time; batch
8 sends 8 at once. Greedy tokens with speculation must equal those without (checked).
Writes OUT/speculative.json and OUT/speculative.md with the machine, its load and versions.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from machine import machine_record, record_load_at_end  # noqa: E402

TARGET_SHAPE = dict(layers=12, hidden=1024, heads=8, kv_heads=2, intermediate=2816)
SEED = 7
K = 4
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": K},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": K},
}
# no prefix cache: each run's prompts are new, and its first side ('off') would leave them
# cached for the other
ENGINE = dict(max_model_len=4096, max_num_seqs=8, max_prefill_tokens=256,
              enable_prefix_caching=False)


def ensure_model(name, shape):
    from msinfer.tools.tiny_model import COPYING_SHAPE, make_tiny_model

    path = os.path.join(ROOT, "models", name)
    if not os.path.isdir(path):
        make_tiny_model(path, copying=True, **dict(COPYING_SHAPE, **shape), seed=SEED)
    return path


def run_workload(llm, workload):
    """(output tokens/s, the greedy tokens): the workload's prompts `batch_size` at a time."""
    from msinfer import SamplingParams

    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0, ignore_eos=True)
    tokens, outputs = 0, []
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), workload.batch_size):
        outs = llm.generate(workload.prompts[first:first + workload.batch_size], params)
        tokens += sum(len(o.token_ids) for o in outs)
        outputs += [list(o.token_ids) for o in outs]
    return tokens / (time.perf_counter() - start), outputs


def spec_counters(llm):
    s = llm.engine.stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def measure(llm, workloads, reps):
    """{off, on: tokens/s runs}, acceptance over the 'on' runs; the tokens checked equal.
    `workloads(rep)`: each rep's prompts, new ones (the suffix proposer's cache of earlier
    outputs would otherwise propose the last rep's answer to the same prompt)."""
    speculation = llm.engine.speculation
    runs = {"off": [], "on": []}
    before = spec_counters(llm)
    for rep in range(reps):
        workload = workloads(rep)
        llm.engine.speculation = None
        off, plain = run_workload(llm, workload)
        llm.engine.speculation = speculation
        on, spec = run_workload(llm, workload)
        if spec != plain:
            raise SystemExit(f"{workload.name} batch {workload.batch_size}: tokens with "
                             f"speculation differ from those without")
        runs["off"].append(off)
        runs["on"].append(on)
    drafts, proposed, accepted = (a - b for a, b in zip(spec_counters(llm), before))
    return runs, dict(drafts=drafts, draft_tokens=proposed, accepted_tokens=accepted,
                      acceptance=round(accepted / proposed, 3) if proposed else None,
                      mean_accepted_per_draft=round(accepted / drafts, 2) if drafts else None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(BENCH, "results"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one round, 1 rep: the harness only")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    args = p.parse_args(argv)
    machine = machine_record()
    target = ensure_model("bench-copying-target", TARGET_SHAPE)
    draft = ensure_model("bench-copying-draft", {})

    from msinfer import LLM
    from spec_workloads import special_tokens, spec_workloads

    specials = special_tokens(target)
    reps = 1 if args.quick else args.reps
    results = {}
    for method in args.methods.split(","):
        settings = METHODS[method]
        settings = dict(settings, model=draft) if method == "draft_model" else settings
        llm = LLM(target, **ENGINE, speculative_config=settings)
        llm.warmup()
        def workloads(seed):
            return spec_workloads(llm.config.vocab_size, specials["<|im_start|>"],
                                  avoid=specials.values(), rounds=1, seed=seed)

        for workload in workloads(1000):  # a first pass of each: the allocator, the graphs
            run_workload(llm, workload)
        for index, workload in enumerate(workloads(0)):
            runs, acceptance = measure(
                llm, lambda rep: workloads(rep)[index], reps)
            off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
            key = f"{method}/{workload.name}/batch{workload.batch_size}"
            results[key] = dict(method=method, workload=workload.name,
                                batch=workload.batch_size,
                                load_average_after=round(os.getloadavg()[0], 2),
                                tokens_per_s_off=round(off, 1), tokens_per_s_on=round(on, 1),
                                speedup=round(on / off, 3),
                                runs={k: [round(x, 1) for x in v] for k, v in runs.items()},
                                **acceptance)
            print(key, results[key], flush=True)
        del llm

    record = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        quick=args.quick, reps=reps, engine=ENGINE, methods=METHODS,
        models=dict(target=f"make-tiny-model --copying {TARGET_SHAPE}, seed {SEED}",
                    draft=f"make-tiny-model --copying (2 layers, hidden 256), seed {SEED}"),
        machine=record_load_at_end(machine), results=results)
    os.makedirs(args.out, exist_ok=True)
    name = "speculative_quick" if args.quick else "speculative"
    path = os.path.join(args.out, name + ".json")
    if set(args.methods.split(",")) != set(METHODS) and os.path.exists(path):
        with open(path) as f:  # --methods: the other methods' rows as they were measured
            kept = json.load(f)
        # files written before bench/machine.py: the commit beside the machine, not in it
        commit = kept["machine"].get("commit") or kept["commit"]
        record["results"] = {**{k: dict(v, commit=commit, date=kept["date"])
                                for k, v in kept["results"].items()
                                if v["method"] not in args.methods.split(",")},
                             **results}
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(markdown(record))
    print(markdown(record))


def markdown(r):
    m = r["machine"]
    lines = [
        "# Speculative decoding on vs off",
        "",
        "The last column is the 1-minute load average after each row: a row measured beside "
        "other work (load well above 2 on these 2 cores) is labelled by it; its ratio is of "
        "runs alternated under the same load, its tokens/s are not comparable to quiet rows.",
        "",
        f"`python bench/speculative.py` at {m['commit']}, {r['date']}; {m['cpu']}, "
        f"{m['cores']} cores, load average {m['load_average_at_start']} at the start, "
        f"{m['load_average_at_end']} at the end; MindSpore {m['mindspore']}.",
        "",
        f"- target: {r['models']['target']}; draft: {r['models']['draft']}",
        f"- k = {K} proposed tokens; greedy, ignore_eos; output tokens/s, median of "
        f"{r['reps']} runs alternated off/on in one process (the same LLM, its speculation "
        f"set aside for 'off'); tokens with speculation equal those without; new prompts "
        f"each run (no request's answer cached from an earlier run)",
        "- grounded: a 384-token 'document', a question, a cue starting a span of the "
        "document: the answer copies the span; no_repeat: distinct random tokens",
        "",
        "| method | workload | batch | off tok/s | on tok/s | on / off | acceptance "
        "| accepted per draft | load after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["results"].values():
        lines.append(f"| {row['method']} | {row['workload']} | {row['batch']} | "
                     f"{row['tokens_per_s_off']} | {row['tokens_per_s_on']} | "
                     f"{row['speedup']}x | {row['acceptance']} | "
                     f"{row['mean_accepted_per_draft']} | {row.get('load_average_after')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
