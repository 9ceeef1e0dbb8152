"""One side of the side-by-side benchmark (msinfer or HF transformers) in its own process.

bench/run.py starts one of these per side, so each side's peak memory is its own, and sends
it requests one JSON line at a time on stdin; the answer is one JSON line on the file
descriptor given by --reply-fd (stdout and stderr stay free for the libraries' logs).

Requests:
  {"op": "generate", "prompts": [[ids], ...], "max_tokens": N}
      greedy, ignore_eos: exactly N new tokens per prompt; answers seconds (wall time around
      the generate call), token_ids, and for msinfer the runner's graph timings and
      compilations
  {"op": "profile", "prompts": [[ids], ...], "max_tokens": N}
      msinfer only: one such generate with every graph call of its decode steps timed
      (MsinferSide.profile)
  {"op": "memory"}  -> current and peak RSS of this process
  {"op": "exit"}
The first answer, sent unasked, reports the load: seconds to load the weights, versions, and
for msinfer its buckets and allocations (weights, KV pool, workspace).
"""
import argparse
import json
import os
import statistics
import sys
import time


def rss_figures():
    """Current (VmRSS) and peak (VmHWM) resident memory of this process, in bytes."""
    figures = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                figures[key] = int(line.split()[1]) * 1024
    return {"rss_bytes": figures["VmRSS"], "peak_rss_bytes": figures["VmHWM"]}


def load_llm(model_dir, **options):
    """LLM(model_dir, **options) of whichever msinfer comes first on the path: the LLM, the
    seconds it took, and the MindSpore version."""
    import mindspore

    from msinfer import LLM

    start = time.perf_counter()
    llm = LLM(model_dir, **options)
    return llm, time.perf_counter() - start, {"mindspore": mindspore.__version__}


def load_hf(model_dir):
    """transformers' model of the checkpoint (Qwen2 or Qwen3) in float32, generating greedily
    with no end-of-sequence stop, so that every call makes exactly max_new_tokens tokens, as
    msinfer's ignore_eos does (min_new_tokens would instead forbid the eos token): the model,
    the seconds it took to load, the versions."""
    import torch
    import transformers

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    seconds = time.perf_counter() - start
    config = model.generation_config
    config.eos_token_id = None
    config.pad_token_id = 0
    config.do_sample = False
    config.temperature = config.top_p = config.top_k = None
    return model, seconds, {"torch": torch.__version__,
                            "transformers": transformers.__version__,
                            "torch_threads": torch.get_num_threads()}


def greedy(max_tokens):
    """msinfer's SamplingParams for exactly max_tokens greedy tokens, no end-of-sequence stop.
    Imported from the package's top level, the one place both this package and the old
    static-batch engine (bench/engine.py's old side, commit 8717a73) export it."""
    from msinfer import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def serve(side, reply_fd, hello, rss_before_load):
    """The worker's end of run.WorkerProcess: answers `hello` with this process's memory,
    then each request line {"op": NAME, ...} with side.NAME(...) and the memory after it;
    {"op": "memory"} is the memory alone, {"op": "exit"} ends."""
    reply = os.fdopen(reply_fd, "w", buffering=1)

    def answer(value):
        reply.write(json.dumps(value) + "\n")

    answer(dict(hello, rss_before_load_bytes=rss_before_load, pid=os.getpid(),
                **rss_figures()))
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "exit":
            break
        answer(rss_figures() if op == "memory" else
               dict(getattr(side, op)(**request), **rss_figures()))


class MsinferSide:
    def __init__(self, model_dir, max_batch, max_len):
        # Prefix caching off: each case repeats its prompts, which the cache would skip, and
        # transformers computes them every time.
        self.llm, self.load_seconds, self.versions = load_llm(
            model_dir, max_num_seqs=max_batch, max_len=max_len, enable_prefix_caching=False)
        runner = self.llm.engine.runner
        self.buckets = {"batch": list(runner.batch_buckets),
                        "chunk": list(runner.chunk_buckets),
                        "context": list(runner.context_buckets),
                        "max_prefill_tokens": self.llm.limits.max_prefill_tokens,
                        "graph_shapes": getattr(self.llm.limits, "graph_shapes", "static")}
        memory = self.llm.memory
        # What the engine allocates: the yardstick of the peak-RSS bar.
        self.allocations = {"weights_bytes": memory.weights_bytes,
                            "kv_cache_bytes": memory.kv_cache_bytes,
                            "workspace_bytes": memory.workspace_bytes,
                            "kv_blocks": memory.layout.num_blocks - 1,
                            "block_size": memory.layout.block_size}

    def generate(self, prompts, max_tokens):
        params = greedy(max_tokens)
        timings = self.llm.engine.runner.timings
        before = dict(timings)
        compiled = self.llm.compilations
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        stats = {k: v - before[k] for k, v in timings.items()}
        return {"seconds": seconds, "token_ids": [o.token_ids for o in outputs],
                "engine_stats": stats, "new_compilations": self.llm.compilations - compiled,
                "compilations": self.llm.compilations,
                # distinct graphs built (an older tree's runner may not list them)
                "graphs": len(getattr(self.llm.engine.runner, "graphs", ()))}

    def profile(self, prompts, max_tokens):
        """Where a decode step goes (run.py --profile): one generate with each graph call of
        its decode steps timed, its output copied to the host so that the time is the call's
        own. Answers, over the steps that decode the whole batch, the medians of the step
        (runner.decode), its embedding, each stack call (and how many a step makes) and
        its lm_head; host = step - the calls (inputs built, logits sliced)."""
        runner = self.llm.engine.runner
        steps, decoding = [], []

        def record(name, seconds):
            if decoding:
                steps[-1][name].append(seconds)

        def decode(seqs):
            steps.append({"batch": len(seqs), "embedding": [], "stack": [], "head": []})
            decoding.append(True)
            start = time.perf_counter()
            try:
                return plain_decode(seqs)
            finally:
                steps[-1]["step"] = time.perf_counter() - start
                decoding.clear()

        plain_decode, plain_cell = runner.decode, runner.cell
        compiled = self.llm.compilations
        names = {"embedding": "embedding", "layers": "stack", "head": "head"}
        runner.cell = lambda graph: Timed(plain_cell(graph), names[graph.part], record)
        runner.decode = decode
        try:
            self.llm.generate(prompts, greedy(max_tokens))
        finally:
            del runner.decode, runner.cell
        full = [s for s in steps if s["batch"] == len(prompts)]
        med = statistics.median
        figures = {"batch": len(prompts), "decode_steps": len(full),
                   "step_seconds": med(s["step"] for s in full),
                   "embedding_seconds": med(sum(s["embedding"]) for s in full),
                   "stack_calls_per_step": len(full[0]["stack"]),
                   "layers_per_stack_call": runner.num_layers // len(full[0]["stack"]),
                   "stack_call_seconds": med(t for s in full for t in s["stack"]),
                   "head_seconds": med(sum(s["head"]) for s in full),
                   "new_compilations": self.llm.compilations - compiled}
        figures["host_seconds"] = med(s["step"] - sum(s["embedding"]) - sum(s["stack"])
                                      - sum(s["head"]) for s in full)
        return figures


class Timed:
    """Stands in for one of the runner's graphs (its other attributes pass through): each
    call's wall time, the output copied to the host first, goes to record(name, seconds)."""

    def __init__(self, graph, name, record):
        self.graph, self.name, self.record = graph, name, record

    def __getattr__(self, attr):  # compile_cache, transposed_for, ...
        return getattr(self.graph, attr)

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.graph(*args)
        out.asnumpy()
        self.record(self.name, time.perf_counter() - start)
        return out


class HFSide:
    def __init__(self, model_dir, max_batch, max_len):
        import torch

        self.torch = torch
        self.model, self.load_seconds, self.versions = load_hf(model_dir)

    def generate(self, prompts, max_tokens):
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("HF side: a batch must hold prompts of one length (no padding)")
        ids = self.torch.tensor(prompts)
        with self.torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids),
                                      max_new_tokens=max_tokens, min_new_tokens=0)
            seconds = time.perf_counter() - start
        generated = out[:, ids.shape[1]:].tolist()
        if any(len(g) != max_tokens for g in generated):
            raise RuntimeError(f"HF generated {len(generated[0])} tokens, not {max_tokens}")
        return {"seconds": seconds, "token_ids": generated}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=("msinfer", "hf"))
    p.add_argument("--model", required=True)
    p.add_argument("--max-batch", type=int, required=True)
    p.add_argument("--max-len", type=int, required=True)
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args()
    baseline = rss_figures()["rss_bytes"]
    cls = MsinferSide if args.side == "msinfer" else HFSide
    side = cls(args.model, args.max_batch, args.max_len)
    serve(side, args.reply_fd, dict(load_seconds=side.load_seconds, versions=side.versions,
                                    buckets=getattr(side, "buckets", None),
                                    allocations=getattr(side, "allocations", None)), baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
