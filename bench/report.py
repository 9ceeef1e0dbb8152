"""Figures derived from a bench run (ratios, bandwidth, the bars), its table and its chart."""
import json
import os


GB = 1e9
# Cores other processes may keep busy during a measurement before bench/run.py takes it
# again (and, if still so, the table names it).
OTHER_LOAD_LIMIT = 0.2
# Per-rank peak memory counts as "near 1/tp" up to this factor above tp1's peak / tp.
MEMORY_SLACK = 1.2
# msinfer's peak RSS goal against what the engine allocates: weights + KV pool (issue 9).
ALLOCATION_SLACK = 1.5


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _ratio(a, b):
    return a / b if a is not None and b else None


def add_derived(results):
    """Adds results["derived"] (ratios, achieved bandwidth) and results["bars"]."""
    cases, limit = results["cases"], results["bandwidth"]["limit_gbs"]
    weights = results["model"]["weight_bytes_per_decode_step"]
    derived = {"ratios_msinfer_over_hf": {}, "bandwidth": {}}
    ratios = derived["ratios_msinfer_over_hf"]
    for name, case in cases.items():
        key = "decode_tokens_per_s" if name.startswith("decode") else "prefill_tokens_per_s"
        ratios[name] = _ratio(_get(case, "msinfer", key), _get(case, "hf", key))
    # Time to first token: a speed ratio too (HF's time over msinfer's), > 1 = msinfer faster.
    ratios["first_token_b1"] = _ratio(_get(cases, "decode_b1", "hf", "first_token_seconds"),
                                      _get(cases, "decode_b1", "msinfer", "first_token_seconds"))
    for side in ("msinfer", "hf"):
        step = _get(cases, "decode_b1", side, "decode_step_seconds")
        achieved = weights / step / GB
        derived["bandwidth"][side] = {
            "achieved_gbs_b1": achieved, "fraction_of_limit": achieved / limit,
            "fraction_of_gemv": achieved / results["bandwidth"]["gemv_gbs"]}
        graph_step = _get(cases, "decode_b1", side, "engine_decode_step_seconds")
        if graph_step:
            derived["bandwidth"][side]["graph_only_gbs_b1"] = weights / graph_step / GB
    dist = results["distributed"]
    tp1 = _get(dist, "tp1", "decode_tokens_per_s")
    tp1_peak = max(_get(dist, "tp1", "peak_rss_bytes_per_rank") or [0]) or None
    derived["distributed"] = {}
    for degree in (2, 4):
        d = dist.get(f"tp{degree}", {})
        peaks = d.get("peak_rss_bytes_per_rank")
        derived["distributed"][f"tp{degree}"] = {
            "tokens_per_s_over_tp1": _ratio(d.get("decode_tokens_per_s"), tp1),
            "peak_rss_per_rank_over_tp1": _ratio(max(peaks), tp1_peak) if peaks else None}
    alloc = _get(results, "load", "msinfer", "allocations")
    if alloc:
        yardstick = alloc["weights_bytes"] + alloc["kv_cache_bytes"]
        derived["peak_rss_over_weights_and_kv"] = _ratio(
            _get(results, "memory", "msinfer", "peak_rss_bytes"), yardstick)
    results["derived"] = derived
    results["bars"] = bars(results)


def _bar(name, value, target, unit="x", at_most=False):
    if value is None:
        return {"bar": name, "target": target, "value": None, "met": False,
                "detail": "not measured (see the run's log)"}
    met = value <= target if at_most else value >= target
    return {"bar": name, "target": target, "value": value, "met": met,
            "detail": f"{value:.3g}{unit} vs {'<=' if at_most else '>='} {target:.3g}{unit} "
                      f"({(value / target - 1) * 100:+.0f}%)"}


def bars(results):
    ratios = results["derived"]["ratios_msinfer_over_hf"]
    dist = results["derived"]["distributed"]
    comp = results["compile"]
    measuring = sum(c.get("msinfer", {}).get("new_compilations_while_measuring", 0)
                    for c in results["cases"].values())
    recompiled = comp["unexpected_compilations"] + comp["recompilations_second_pass"] + measuring
    out = [
        _bar("batch-1 decode tokens/s, msinfer / HF", ratios.get("decode_b1"), 1.0),
        _bar("batch-1 decode, fraction of the bandwidth limit",
             results["derived"]["bandwidth"]["msinfer"]["fraction_of_limit"], 0.85, ""),
        _bar("batch-16 decode tokens/s, msinfer / HF", ratios.get("decode_b16"), 1.5),
        _bar("512-token prefill tokens/s, msinfer / HF", ratios.get("prefill_512"), 1.0),
        {"bar": "no recompilation inside a bucket", "target": 0, "value": recompiled,
         "met": recompiled == 0,
         "detail": f"{recompiled} graphs compiled beyond one per "
                   f"{'graph' if comp.get('dynamic') else 'bucket'} "
                   f"({comp['graphs_compiled']} graphs for 20 lengths, "
                   f"{comp['compile_seconds_per_graph']:.1f} s each)"},
        _bar("msinfer peak RSS / (weights + KV pool)",
             results["derived"].get("peak_rss_over_weights_and_kv"), ALLOCATION_SLACK,
             at_most=True),
        _bar("tp2 tokens/s / tp1", dist["tp2"]["tokens_per_s_over_tp1"], 0.85),
        _bar("tp4 tokens/s / tp1", dist["tp4"]["tokens_per_s_over_tp1"], 0.6),
    ]
    for degree in (2, 4):
        value = dist[f"tp{degree}"]["peak_rss_per_rank_over_tp1"]
        out.append(_bar(f"tp{degree} peak RSS per rank / tp1's (near 1/{degree})", value,
                        MEMORY_SLACK / degree, at_most=True))
    return out


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(results):
    cases, der = results["cases"], results["derived"]
    m = results["machine"]
    lines = [f"msinfer vs HF transformers: {results['model']['dir']}, float32, "
             f"{m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB"
             + ("  [--quick: figures mean nothing]" if results["quick"] else ""),
             f"{'figure':<46}{'msinfer':>12}{'HF':>12}{'ms/HF':>8}"]

    def row(label, ms, hf, spec, ratio=None):
        lines.append(f"{label:<46}{_fmt(ms, spec):>12}{_fmt(hf, spec):>12}"
                     f"{_fmt(ratio, '.2f'):>8}")

    load = results["load"]
    row("weight load (s)", load["msinfer"]["seconds"], load["hf"]["seconds"], ".1f")
    b1 = cases["decode_b1"]
    comp = results["compile"]
    row("graphs compiled, 20 prompt lengths", comp["graphs_compiled"], None, "d")
    row("compile time, all of them (s)", comp["compile_seconds"], None, ".1f")
    row("compile time per graph (s)", comp["compile_seconds_per_graph"], None, ".1f")
    row("warm-up calls of the cases below (s)",
        sum(c["msinfer"]["warmup_seconds"] for c in cases.values()),
        sum(c["hf"]["warmup_seconds"] for c in cases.values()), ".1f")
    row(f"time to first token, {b1['prompt_len']}-token prompt (ms)",
        b1["msinfer"]["first_token_seconds"] * 1e3, b1["hf"]["first_token_seconds"] * 1e3,
        ".0f", der["ratios_msinfer_over_hf"]["first_token_b1"])
    row("per-output-token time, batch 1 (ms)", b1["msinfer"]["decode_step_seconds"] * 1e3,
        b1["hf"]["decode_step_seconds"] * 1e3, ".1f",
        der["ratios_msinfer_over_hf"]["decode_b1"])
    for name, case in cases.items():
        if name.startswith("decode"):
            row(f"decode tokens/s, batch {case['batch']}", case["msinfer"]["decode_tokens_per_s"],
                case["hf"]["decode_tokens_per_s"], ".2f", der["ratios_msinfer_over_hf"][name])
    for name, case in cases.items():
        if name.startswith("prefill"):
            row(f"prefill tokens/s, {case['prompt_len']}-token prompt",
                case["msinfer"]["prefill_tokens_per_s"], case["hf"]["prefill_tokens_per_s"],
                ".1f", der["ratios_msinfer_over_hf"][name])
    bw = der["bandwidth"]
    row("weights read, batch-1 decode (GB/s)", bw["msinfer"]["achieved_gbs_b1"],
        bw["hf"]["achieved_gbs_b1"], ".1f")
    row(f"  fraction of the {results['bandwidth']['limit_gbs']:.1f} GB/s limit",
        bw["msinfer"]["fraction_of_limit"], bw["hf"]["fraction_of_limit"], ".2f")
    mem = results["memory"]
    row("peak RSS per process (GB)", mem["msinfer"]["peak_rss_bytes"] / GB,
        mem["hf"]["peak_rss_bytes"] / GB, ".2f")
    alloc = results["load"]["msinfer"].get("allocations")
    if alloc:
        row("  msinfer weights + KV pool (GB)",
            (alloc["weights_bytes"] + alloc["kv_cache_bytes"]) / GB, None, ".2f")
        row("  peak RSS / (weights + KV pool)", der.get("peak_rss_over_weights_and_kv"), None,
            ".2f")
    other = sum(c[s]["other_cpu_seconds_while_measuring"] for c in cases.values()
                for s in ("msinfer", "hf"))
    measured = sum(c[s]["measured_seconds"] for c in cases.values() for s in ("msinfer", "hf"))
    lines.append(f"other processes used {other:.0f} CPU-seconds during the {measured:.0f} s "
                 f"measured ({other / measured:.2f} of {m['cores']} cores on average)")
    noisy = [f"{name} {side} ({max(c[side]['other_load_cores_per_rep']):.2f} cores)"
             for name, c in cases.items() for side in ("msinfer", "hf")
             if max(c[side].get("other_load_cores_per_rep") or [0]) > OTHER_LOAD_LIMIT]
    retaken = sum(c[s].get("reps_retaken", 0) for c in cases.values() for s in ("msinfer", "hf"))
    lines.append(f"measurements taken again for load from other processes: {retaken}; still "
                 "loaded: " + (", ".join(noisy) if noisy else "none"))
    bwp = results["bandwidth"]
    lines.append(f"bandwidth probe (GB/s): gemv {bwp['gemv_gbs']:.1f}, read {bwp['read_gbs']:.1f},"
                 f" copy {bwp['copy_gbs']:.1f}; BLAS "
                 + ", ".join(f"{lib['internal_api']} {lib['version']} {lib['architecture']}"
                             for lib in bwp["blas"].get("libraries", [])))

    if results.get("profile"):
        lines.append("")
        lines.append("where an msinfer decode step goes (--profile; each call's output copied "
                     "to the host), ms")
        for p in results["profile"].values():
            lines.append(
                f"batch {p['batch']:>2}: step {p['step_seconds'] * 1e3:.1f} = embedding "
                f"{p['embedding_seconds'] * 1e3:.1f} + {p['stack_calls_per_step']} call(s) of "
                f"{p['layers_per_stack_call']} layers x {p['stack_call_seconds'] * 1e3:.2f} + "
                f"lm_head {p['head_seconds'] * 1e3:.1f} + host {p['host_seconds'] * 1e3:.1f}")

    dist = results["distributed"]
    lines.append("")
    lines.append(f"tensor parallel under mpirun ({dist['model']['dir']}: "
                 f"{dist['model']['heads']} heads), batch 1")
    lines.append(f"{'job':<14}{'tokens/s':>10}{'vs tp1':>8}{'peak RSS/rank GB':>20}"
                 f"{'collectives/token':>19}{'ms in them/token':>18}{'others (cores)':>16}")
    tp1 = _get(dist, "tp1", "decode_tokens_per_s")
    for label, d in dist.items():
        if not label.startswith("tp"):
            continue
        if "error" in d:
            lines.append(f"{label:<14}  failed: {d['error']}")
            continue
        vs = _ratio(d["decode_tokens_per_s"], tp1)
        peaks = "/".join(f"{b / GB:.2f}" for b in d["peak_rss_bytes_per_rank"])
        coll = d.get("collective_seconds_per_token")
        lines.append(f"{label:<14}{d['decode_tokens_per_s']:>10.2f}{_fmt(vs, '.2f'):>8}"
                     f"{peaks:>20}{_fmt(d.get('collectives_per_token'), 'd'):>19}"
                     f"{_fmt(coll and coll * 1e3, '.1f'):>18}"
                     f"{d['other_cpu_seconds_during_job'] / d['job_seconds']:>16.2f}")
    if any("_threads" in label for label in dist):
        lines.append("(tpN_threadsK: the same job with MindSpore's runtime_num_threads=K per "
                     "rank)")
    lines.append("")
    lines.append("bars")
    for b in results["bars"]:
        lines.append(f"  [{'met ' if b['met'] else 'MISS'}] {b['bar']}: {b['detail']}")
    return "\n".join(lines)


def chart(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))

    def grouped(ax, labels, ms, hf, title, ylabel):
        xs = range(len(labels))
        for offset, values, name, color in ((-0.2, ms, "msinfer", "tab:blue"),
                                            (0.2, hf, "HF transformers", "tab:orange")):
            bars = ax.bar([x + offset for x in xs], values, 0.4, label=name, color=color)
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(list(xs), labels)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper left")

    decode = [c for n, c in cases.items() if n.startswith("decode")]
    grouped(axes[0], [f"batch {c['batch']}" for c in decode],
            [c["msinfer"]["decode_tokens_per_s"] for c in decode],
            [c["hf"]["decode_tokens_per_s"] for c in decode],
            "decode tokens/s by batch\n(one msinfer instance: up to 16 sequences of 1024)", "tokens/s")
    prefill = [c for n, c in cases.items() if n.startswith("prefill")]
    grouped(axes[1], [f"{c['prompt_len']} tokens" for c in prefill],
            [c["msinfer"]["prefill_tokens_per_s"] for c in prefill],
            [c["hf"]["prefill_tokens_per_s"] for c in prefill], "prefill tokens/s by prompt",
            "tokens/s")

    ax = axes[2]
    dist = results["distributed"]
    jobs = [k for k, d in dist.items() if k.startswith("tp") and "decode_tokens_per_s" in d]
    bars = ax.bar([k.replace("_threads", "\nthreads ") for k in jobs],
                  [dist[k]["decode_tokens_per_s"] for k in jobs],
                  color=["tab:blue" if "_" not in k else "tab:cyan" for k in jobs],
                  label="msinfer (mpirun); cyan: threads per rank set")
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.axhline(cases["decode_b1"]["hf"]["decode_tokens_per_s"], color="tab:orange",
               linestyle="--", label="HF, one process")
    rank0 = dist[jobs[0]]["ranks"][0] if jobs else {}
    cache_len = rank0.get("prompt_len", 0) + rank0.get("new_tokens", 0) + 1
    ax.set_title(f"batch-1 decode tokens/s by tensor degree\n({dist['model']['heads']}-head "
                 f"variant, same size; one sequence of {cache_len})", fontsize=10)
    ax.set_ylabel("tokens/s")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.25)
    ax.legend(fontsize=8, loc="upper right")

    save_chart(fig, path, results, f"{results['model']['dir']} (float32)")


def write_results(results, out_dir, name, chart, table):
    """OUT_DIR/NAME.json (every figure), NAME.png (chart(results, path)) and NAME.txt (the
    table, also printed); returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{name}.{ext}") for ext in ("json", "png", "txt")]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=1)
    chart(results, paths[1])
    text = table(results)
    with open(paths[2], "w") as f:
        f.write(text + "\n")
    print(text)
    return paths


def save_chart(fig, path, results, subject):
    """Titles a benchmark's chart with what, on which machine and when, and writes it."""
    import matplotlib.pyplot as plt

    m = results["machine"]
    fig.suptitle(f"{subject}, {m['cpu']}, {m['cores']} cores, {results['date'][:10]}"
                 + ("  [--quick]" if results["quick"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
