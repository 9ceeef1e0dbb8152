"""msinfer vs HF transformers on this machine, against its memory-bandwidth limit.

    python bench/run.py [--quick] [--profile] [--shape qwen3-0.6b-shape] [--out bench/results]

One command: makes the random Qwen2 checkpoints (--shape qwen3-0.6b-shape: Qwen3) if missing
(models/, git-ignored), measures the machine's streaming bandwidth, runs msinfer and HF
transformers side by side on the same prompts with the same greedy settings, runs msinfer at
tensor degree 1, 2 and 4 under mpirun, then writes OUT/latest.json (every figure, the machine,
the versions), OUT/latest.png and OUT/latest.txt (the table, also printed; --shape
qwen3-0.6b-shape: OUT/qwen3_0.6b.*). bench/README.md says what each figure means and how it
is measured.
--quick uses a small model and few tokens: it checks the harness; its figures mean nothing.
"""
import argparse
import datetime
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

from msinfer.config import ModelConfig  # noqa: E402  (no mindspore import)

import report  # noqa: E402
from machine import machine_record, record_load_at_end  # noqa: E402

# The variables an old OpenBLAS needs on some processors; they make a current numpy pick a
# slower kernel. Unset for the benchmark's own processes only (see README).
OPENBLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")

QWEN2_05B_SHAPE = ["--preset", "qwen2-0.5b-shape"]
SMALL_SHAPE = ["--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "2",
               "--vocab", "8192", "--tie"]
# 14 heads do not split over 4 ranks, so the distributed part runs every degree on the same
# shape with 16 heads of 56 (hidden stays 896; weights within 1% of the real shape's).
FULL = dict(model=("qwen2-0.5b-shape", QWEN2_05B_SHAPE),
            dist_model=("qwen2-0.5b-shape-16h", QWEN2_05B_SHAPE + ["--heads", "16"]),
            prompt_len=32, decode_tokens={1: 64, 4: 32, 16: 32}, prefill_lens=(128, 512),
            reps=3, max_len=1024, dist_new_tokens=32, dist_reps=3, dist_timeout=900)
# --shape qwen3-0.6b-shape: Qwen3-0.6B's shape (16 query heads of 128 over 8 KV heads, hidden
# 1024, q/k norms), which splits over 4 ranks as it is.
QWEN3_06B = dict(FULL, model=("qwen3-0.6b-shape", ["--preset", "qwen3-0.6b-shape"]),
                 dist_model=("qwen3-0.6b-shape", ["--preset", "qwen3-0.6b-shape"]))
SHAPES = {"qwen2-0.5b-shape": (FULL, "latest"), "qwen3-0.6b-shape": (QWEN3_06B, "qwen3_0.6b")}
QUICK = dict(model=("small", SMALL_SHAPE), dist_model=("small", SMALL_SHAPE),
             prompt_len=16, decode_tokens={1: 8, 4: 8, 16: 8}, prefill_lens=(128, 512),
             reps=2, max_len=1024, dist_new_tokens=8, dist_reps=2, dist_timeout=300)
# 20 prompt lengths over the chunk buckets (16, 64, 256) and context buckets (64 ... 1024),
# several inside each bucket; 257 ... 512 take two chunks.
COMPILE_LENGTHS = (5, 9, 16, 17, 25, 32, 33, 47, 64, 65, 90, 128, 129, 200, 256, 257, 300,
                   400, 480, 512)
TENSOR_DEGREES = (1, 2, 4)
OTHER_LOAD_LIMIT = report.OTHER_LOAD_LIMIT
RETRIES = 4  # per side and case (--retries)


def child_env():
    env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_OVERRIDES}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", GLOG_v="3")
    # mpirun and msrun start `python` from PATH: make it this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def ensure_model(name, flags, log):
    path = os.path.join(ROOT, "models", name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        log(f"making {path} ...")
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "msinfer", "make-tiny-model", path] + flags,
                       env=child_env(), check=True, cwd=ROOT)
    return path


def weight_bytes(config):
    """Bytes of weights one decode step reads: every tensor once, float32 (a tied embedding
    once, as the lm_head; the embedding lookup reads only the batch's rows)."""
    return 4 * config.num_parameters()


def cpu_seconds(pid):
    """User + system CPU seconds a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds():
    """CPU seconds all processes on the machine have used so far (every core)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class WorkerProcess:
    """A bench worker script in a process of its own: one JSON request in on its stdin, one
    JSON answer out on a pipe of its own (--reply-fd), its logs in LOG_PATH. The first answer,
    sent unasked, is `hello`."""

    def __init__(self, name, script, args, log_path, env=None, cwd=ROOT):
        self.name = name
        read_fd, write_fd = os.pipe()
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(BENCH, script), *args, "--reply-fd", str(write_fd)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True,
            env=env or child_env(), cwd=cwd, pass_fds=(write_fd,))
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.hello = self._answer()

    def _answer(self):
        line = self.replies.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the {self.name} worker exited ({self.proc.returncode}); see "
                               f"{self.log.name}")
        return json.loads(line)

    def ask(self, **request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self):
        self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


class Side(WorkerProcess):
    """A side_worker.py process (msinfer or HF)."""

    def __init__(self, name, model_dir, max_batch, max_len, log_dir):
        super().__init__(name, "side_worker.py",
                         [name, "--model", model_dir, "--max-batch", str(max_batch),
                          "--max-len", str(max_len)], os.path.join(log_dir, f"{name}.log"))


def prompts_for(rng, batch, length, vocab):
    return rng.integers(0, vocab, (batch, length)).tolist()


def run_pair(sides, prompts, max_tokens, reps, log):
    """Warm-up, then `reps` rounds; in each round every side makes 1 and max_tokens tokens,
    the sides taking turns (first side alternates) so drift on the machine hits both.
    Also records the CPU time the idle side used while the other was measured, and the CPU
    time other processes on the machine used meanwhile (other engineers' jobs, say): a
    measurement during which they used more than OTHER_LOAD_LIMIT cores is taken again, up
    to RETRIES times per side and case, and the count is reported."""
    result = {}
    for side in sides:
        start = time.perf_counter()
        warm = [side.ask(op="generate", prompts=prompts, max_tokens=n)
                for n in sorted({1, max_tokens})]
        result[side.name] = {"warmup_seconds": time.perf_counter() - start,
                             "warmup_new_compilations": sum(w.get("new_compilations", 0)
                                                            for w in warm),
                             "first": [], "full": [], "idle_peer_cpu_seconds": 0.0,
                             "other_cpu_seconds": 0.0, "measured_seconds": 0.0,
                             "other_load": [], "retaken": 0}
    for rep in range(reps):
        order = sides if rep % 2 == 0 else sides[::-1]
        for side in order:
            r = result[side.name]
            while True:
                first, full, other, peer_used, seconds = measure(side, sides, prompts,
                                                                 max_tokens)
                r["idle_peer_cpu_seconds"] += peer_used
                r["other_cpu_seconds"] += other
                r["measured_seconds"] += seconds
                if other / seconds <= OTHER_LOAD_LIMIT or r["retaken"] >= RETRIES:
                    break
                r["retaken"] += 1
                log(f"  {side.name}: other processes used {other / seconds:.2f} cores; "
                    "measuring again")
            r["other_load"].append(other / seconds)
            r["first"].append(first)
            r["full"].append(full)
    figures = {}
    batch, length = len(prompts), len(prompts[0])
    for name, r in result.items():
        firsts = [x["seconds"] for x in r["first"]]
        f = {"warmup_seconds": r["warmup_seconds"],
             "warmup_new_compilations": r["warmup_new_compilations"],
             "first_token_seconds": statistics.median(firsts),
             "first_token_seconds_all": firsts,
             "prefill_tokens_per_s": batch * length / statistics.median(firsts),
             "peer_cpu_seconds_while_measuring": r["idle_peer_cpu_seconds"],
             "other_cpu_seconds_while_measuring": r["other_cpu_seconds"],
             "measured_seconds": r["measured_seconds"],
             "other_load_cores_per_rep": r["other_load"], "reps_retaken": r["retaken"]}
        if max_tokens > 1:
            steps = [(full["seconds"] - first["seconds"]) / (max_tokens - 1)
                     for first, full in zip(r["first"], r["full"])]
            step = statistics.median(steps)
            f.update(decode_step_seconds=step, decode_step_seconds_all=steps,
                     decode_tokens_per_s=batch / step,
                     full_seconds_all=[x["seconds"] for x in r["full"]])
            if "engine_stats" in r["full"][0]:
                # The engine's own timers: graph execution only, no sampling or host work.
                graph_steps = [x["engine_stats"]["decode_s"] / x["engine_stats"]["decode_steps"]
                               for x in r["full"]]
                f["engine_decode_step_seconds"] = statistics.median(graph_steps)
        if "engine_stats" in r["first"][0]:
            f["engine_prefill_seconds"] = statistics.median(
                x["engine_stats"]["prefill_s"] for x in r["first"])
            f["new_compilations_while_measuring"] = sum(
                x["new_compilations"] for x in r["first"] + r["full"])
        figures[name] = f
        log(f"  {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in f.items()
                                      if isinstance(v, float)))
    if len(sides) == 2:
        a, b = (result[s.name]["full"][-1]["token_ids"] for s in sides)
        same = sum(x == y for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))
        figures["greedy_tokens_identical"] = same / sum(len(row) for row in a)
    figures.update(batch=batch, prompt_len=length, max_tokens=max_tokens, reps=reps)
    return figures


def measure(side, sides, prompts, max_tokens):
    """One timed pair of generate calls (1 token, max_tokens tokens) on `side`; returns
    their answers, the CPU seconds other processes used meanwhile, the idle side's, and
    the wall seconds."""
    peers = [s for s in sides if s is not side]
    peer_cpu = [cpu_seconds(p.proc.pid) for p in peers]
    own_cpu, busy, start = cpu_seconds(side.proc.pid), machine_busy_seconds(), \
        time.perf_counter()
    first = side.ask(op="generate", prompts=prompts, max_tokens=1)
    full = side.ask(op="generate", prompts=prompts, max_tokens=max_tokens) \
        if max_tokens > 1 else first
    seconds = time.perf_counter() - start
    peer_used = sum(cpu_seconds(p.proc.pid) - c for p, c in zip(peers, peer_cpu))
    other = (machine_busy_seconds() - busy - peer_used - (cpu_seconds(side.proc.pid) - own_cpu))
    return first, full, max(other, 0.0), peer_used, seconds


def bucket_for(size, buckets):
    return next(b for b in buckets if size <= b)


def graph_keys(prompt_len, max_tokens, buckets):
    """The graphs (by input shape) one batch-1 generate compiles, mirroring the scheduler and
    runner: the prompt in chunks of at most max_prefill_tokens while more than one of its
    tokens is pending, each padded to a chunk bucket over a context bucket (embedding,
    decoder layer, lm_head on one row); a last single pending token and every new token go
    through decode at batch 1 over the context bucket of the sequence's length."""
    keys, start = set(), 0
    while prompt_len - start > 1:
        count = min(buckets["max_prefill_tokens"], prompt_len - start)
        chunk = bucket_for(count, buckets["chunk"])
        context = bucket_for(start + count, buckets["context"])
        keys |= {("embedding", chunk), ("layer", "prefill", chunk, context), ("head", chunk, 1)}
        start += count
    first_decode = prompt_len if start < prompt_len else prompt_len + 1
    for length in range(first_decode, prompt_len + max_tokens):
        keys |= {("embedding", 1), ("layer", "decode", 1, bucket_for(length, buckets["context"])),
                 ("head", 1, 1)}
    return keys


def compile_pass(side, lengths, vocab, rng, log):
    """Generate 2 tokens for each of 20 prompt lengths, twice. The first pass compiles one
    graph per new input shape with static graphs (embedding, decoder layer, lm_head: chunk
    bucket x context bucket for prefill, batch 1 x context bucket for decode), with graphs of
    dynamic shape one per graph the runner builds (MindSpore compiling one again for a new
    length would show), and nothing else; the second pass must compile nothing. Compile
    cost = first pass - second pass."""
    buckets = side.hello["buckets"]
    dynamic = buckets.get("graph_shapes") == "dynamic"
    prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]
    passes, seen, graphs = [], set(), 0
    for _ in range(2):
        calls = []
        for prompt in prompts:
            keys = graph_keys(len(prompt), 2, buckets)
            out = side.ask(op="generate", prompts=[prompt], max_tokens=2)
            expected = out["graphs"] - graphs if dynamic else len(keys - seen)
            calls.append({"prompt_len": len(prompt), "seconds": out["seconds"],
                          "new_compilations": out["new_compilations"],
                          "expected_new": expected})
            seen |= keys
            graphs = out["graphs"]
        passes.append(calls)
    first, second = (sum(c["seconds"] for c in calls) for calls in passes)
    compiled = sum(c["new_compilations"] for c in passes[0])
    unexpected = sum(max(0, c["new_compilations"] - c["expected_new"])
                     for calls in passes for c in calls)
    figures = {"prompt_lengths": list(lengths), "dynamic": dynamic, "graphs_compiled": compiled,
               "graphs_expected": graphs if dynamic else len(seen),
               "recompilations_second_pass": sum(c["new_compilations"] for c in passes[1]),
               "unexpected_compilations": unexpected,
               "first_pass_seconds": first, "second_pass_seconds": second,
               "compile_seconds": first - second,
               "compile_seconds_per_graph": (first - second) / max(compiled, 1),
               "calls": passes}
    log(f"  {compiled} graphs for {len(lengths)} lengths (expected "
        f"{figures['graphs_expected']}), compile {first - second:.1f}s, second pass recompiled "
        f"{figures['recompilations_second_pass']}")
    return figures


def run_distributed(model_dir, degree, cfg, log_dir, log, threads=0):
    mpirun = shutil.which("mpirun")
    if not mpirun:
        return {"error": "mpirun not found (Debian: openmpi-bin)"}
    out_dir = tempfile.mkdtemp(prefix=f"msinfer-bench-tp{degree}-")
    cmd = [mpirun, "-n", str(degree), "--bind-to", "none", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, os.path.join(BENCH, "dist_worker.py"), "--model", model_dir,
            "--strategy", os.path.join(ROOT, "strategies", f"qwen2_tp{degree}.yaml"),
            "--out", out_dir, "--prompt-len", str(cfg["prompt_len"]),
            "--new-tokens", str(cfg["dist_new_tokens"]), "--reps", str(cfg["dist_reps"]),
            "--threads", str(threads)]
    label = f"tp{degree}" + (f"_threads{threads}" if threads else "")
    log_path = os.path.join(log_dir, f"{label}.log")
    start, busy, children = time.perf_counter(), machine_busy_seconds(), children_cpu_seconds()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                env=child_env(), cwd=BENCH, start_new_session=True)
        try:
            code = proc.wait(timeout=cfg["dist_timeout"])
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # any rank or scheduler left behind
            except ProcessLookupError:
                pass
    wall = time.perf_counter() - start
    # mpirun waits for its ranks, so their CPU time is in this process's children's.
    other = machine_busy_seconds() - busy - (children_cpu_seconds() - children)
    ranks = []
    for r in range(degree):
        path = os.path.join(out_dir, f"rank_{r}.json")
        if os.path.isfile(path):
            with open(path) as f:
                ranks.append(json.load(f))
    shutil.rmtree(out_dir, ignore_errors=True)
    if code != 0 or len(ranks) != degree:
        with open(log_path) as f:
            tail = f.read()[-2000:]
        log(f"  {label} failed ({code}); see {log_path}")
        return {"error": f"exit {code}, {len(ranks)} of {degree} ranks reported", "log_tail": tail,
                "job_seconds": wall}
    step = max(r["decode_step_seconds"] for r in ranks)  # the job runs at its slowest rank
    figures = {"ranks": ranks, "job_seconds": wall, "other_cpu_seconds_during_job": other,
               "decode_step_seconds": step,
               "decode_tokens_per_s": 1 / step,
               "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
               "param_bytes_per_rank": [r["param_bytes"] for r in ranks]}
    if degree > 1:
        figures["collective_seconds_per_token"] = statistics.median(
            r["collective_seconds_per_token"] for r in ranks)
        figures["collectives_per_token"] = ranks[0]["allreduces_per_step"] + \
            ranks[0]["allgathers_per_step"]
    log(f"  {label}: {1 / step:.2f} tokens/s, peak RSS per rank "
        + ", ".join(f"{b / 1e9:.2f} GB" for b in figures["peak_rss_bytes_per_rank"]))
    return figures


def children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def openblas_overrides():
    """OPENBLAS_OVERRIDES as this process's environment has them (child_env drops them)."""
    return {k: os.environ.get(k) for k in OPENBLAS_OVERRIDES}


def main(argv=None):
    global RETRIES
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small model, few tokens: checks the harness in a few minutes")
    p.add_argument("--out", default=os.path.join(BENCH, "results"))
    p.add_argument("--shape", choices=SHAPES, default="qwen2-0.5b-shape",
                   help="the random checkpoint's shape (default qwen2-0.5b-shape, written to "
                        "OUT/latest.*; qwen3-0.6b-shape to OUT/qwen3_0.6b.*)")
    p.add_argument("--reps", type=int, help="measured rounds per case (full run: 3)")
    p.add_argument("--retries", type=int, default=RETRIES,
                   help=f"measurements taken again per side and case when other processes "
                        f"load the machine (default {RETRIES})")
    p.add_argument("--threads-variants", action="store_true",
                   help="also run tp2/tp4 with runtime_num_threads = cores / ranks")
    p.add_argument("--profile", action="store_true",
                   help="after the decode cases, time each graph call of one more msinfer "
                        "generate per batch: where a decode step goes")
    args = p.parse_args(argv)
    full, name = SHAPES[args.shape]
    cfg = dict(QUICK if args.quick else full)
    if args.reps:
        cfg["reps"] = cfg["dist_reps"] = args.reps
    RETRIES = args.retries
    os.makedirs(args.out, exist_ok=True)
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    began = time.perf_counter()

    def log(message):
        print(f"[bench {time.perf_counter() - began:6.0f}s] {message}", flush=True)

    import numpy as np
    rng = np.random.default_rng(0)
    results = {"quick": args.quick, "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": dict(machine_record(),
                               openblas_overrides_in_parent_env=openblas_overrides()),
               "reps": cfg["reps"], "retries": RETRIES}
    model_dir = ensure_model(*cfg["model"], log)
    dist_model_dir = ensure_model(*cfg["dist_model"], log)
    config = ModelConfig.from_model_dir(model_dir)
    results["model"] = {"dir": os.path.relpath(model_dir, ROOT), "layers": config.num_layers,
                        "hidden": config.hidden_size, "heads": config.num_heads,
                        "kv_heads": config.num_kv_heads,
                        "intermediate": config.intermediate_size, "vocab": config.vocab_size,
                        "tied": config.tie_word_embeddings, "dtype": "float32",
                        "parameters": config.num_parameters(),
                        "weight_bytes_per_decode_step": weight_bytes(config)}

    log("bandwidth probe")
    probe = subprocess.run([sys.executable, os.path.join(BENCH, "bandwidth.py")]
                           + (["--quick"] if args.quick else []),
                           env=child_env(), capture_output=True, text=True, check=True)
    results["bandwidth"] = json.loads(probe.stdout)
    log(f"  limit {results['bandwidth']['limit_gbs']:.1f} GB/s")

    max_batch = max(cfg["decode_tokens"])
    log("loading msinfer, then HF transformers")
    sides = [Side("msinfer", model_dir, max_batch, cfg["max_len"], log_dir)]
    sides.append(Side("hf", model_dir, max_batch, cfg["max_len"], log_dir))
    msinfer, hf = sides
    results["load"] = {s.name: {"seconds": s.hello["load_seconds"],
                                "rss_before_load_bytes": s.hello["rss_before_load_bytes"],
                                "rss_after_load_bytes": s.hello["rss_bytes"],
                                "peak_rss_after_load_bytes": s.hello["peak_rss_bytes"]}
                       for s in sides}
    results["load"]["msinfer"]["allocations"] = msinfer.hello["allocations"]
    results["load"]["msinfer"]["buckets"] = msinfer.hello["buckets"]
    results["machine"].update(msinfer.hello["versions"], **hf.hello["versions"])

    log("msinfer compilations over 20 prompt lengths")
    results["compile"] = compile_pass(msinfer, COMPILE_LENGTHS, config.vocab_size, rng, log)
    # Where each process's memory grows: RSS after loading, the compile pass and each case.
    memory_trace = {s.name: [("load", s.hello["rss_bytes"])] for s in sides}
    memory_trace["msinfer"].append(("compile pass", msinfer.ask(op="memory")["rss_bytes"]))

    cases, decode_prompts = {}, {}
    for batch, tokens in cfg["decode_tokens"].items():
        log(f"decode, batch {batch}: {tokens} tokens after a {cfg['prompt_len']}-token prompt")
        prompts = decode_prompts[batch] = prompts_for(rng, batch, cfg["prompt_len"],
                                                      config.vocab_size)
        cases[f"decode_b{batch}"] = run_pair(sides, prompts, tokens, cfg["reps"], log)
        for s in sides:
            memory_trace[s.name].append((f"decode_b{batch}", s.ask(op="memory")["rss_bytes"]))
    for length in cfg["prefill_lens"]:
        log(f"prefill, {length}-token prompt")
        prompts = prompts_for(rng, 1, length, config.vocab_size)
        cases[f"prefill_{length}"] = run_pair(sides, prompts, 1, cfg["reps"], log)
        for s in sides:
            memory_trace[s.name].append((f"prefill_{length}", s.ask(op="memory")["rss_bytes"]))
    results["cases"] = cases
    results["memory"] = {s.name: dict(s.ask(op="memory"), rss_bytes_after=memory_trace[s.name])
                         for s in sides}
    if args.profile:  # after the figures above, on shapes their cases compiled
        results["profile"] = {}
        for batch, tokens in cfg["decode_tokens"].items():
            log(f"profile, batch {batch}")
            results["profile"][f"decode_b{batch}"] = msinfer.ask(
                op="profile", prompts=decode_prompts[batch], max_tokens=tokens)
    for s in sides:
        s.close()

    dist_config = ModelConfig.from_model_dir(dist_model_dir)
    results["distributed"] = {"model": {
        "dir": os.path.relpath(dist_model_dir, ROOT), "heads": dist_config.num_heads,
        "kv_heads": dist_config.num_kv_heads, "head_dim": dist_config.head_dim,
        "weight_bytes_per_decode_step": weight_bytes(dist_config)}}
    for degree in TENSOR_DEGREES:
        log(f"distributed tp{degree} under mpirun")
        results["distributed"][f"tp{degree}"] = run_distributed(dist_model_dir, degree, cfg,
                                                                log_dir, log)
    # The same jobs with the cores shared out (MindSpore's runtime_num_threads per rank):
    # shows how much of the tp cost is ranks' thread pools fighting over 2 cores.
    for degree in TENSOR_DEGREES[1:] if args.threads_variants else ():
        threads = max(1, os.cpu_count() // degree)
        log(f"distributed tp{degree} under mpirun, {threads} thread(s) per rank")
        results["distributed"][f"tp{degree}_threads{threads}"] = run_distributed(
            dist_model_dir, degree, cfg, log_dir, log, threads)
    results["seconds"] = time.perf_counter() - began
    record_load_at_end(results["machine"])

    report.add_derived(results)
    paths = report.write_results(results, args.out, "latest" if args.quick else name,
                                 report.chart, report.table)
    log(f"wrote {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
