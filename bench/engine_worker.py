"""One side of bench/engine.py in its own process: msinfer's engine or HF transformers.

bench/engine.py starts one per side and configuration (each process's memory is its own)
and sends it requests one JSON line at a time on stdin; the answer is one JSON line on the
file descriptor given by --reply-fd (stdout and stderr stay free for the libraries' logs).

Requests (all greedy, no end-of-sequence stop, exactly max_tokens new tokens per request):
  {"op": "generate", "prompts": [...], "max_tokens": [n, ...]}
      the prompts run together (one generate call; HF: continuous batching, see HFSide);
      answers seconds, token_ids, compilations (msinfer sides) and peak RSS after it
  {"op": "warmup"}      msinfer only: engine.warmup() from here; graphs and seconds
  {"op": "ttft", ...}   msinfer only: see MsinferSide.ttft
  {"op": "exit"}
The first answer, sent unasked, reports the load: seconds, RSS, versions, allocations.
"""
import argparse
import json
import statistics
import sys
import time

from side_worker import greedy, load_hf, load_llm, rss_figures, serve


class MsinferSide:
    """msinfer's engine: LLM(model_dir, **options) with the options engine.py passes."""

    def __init__(self, model_dir, options):
        self.llm, self.load_seconds, self.versions = load_llm(model_dir, **options)
        memory, limits = self.llm.memory, self.llm.limits
        self.info = {"weights_bytes": memory.weights_bytes,
                     "kv_cache_bytes": memory.kv_cache_bytes,
                     "workspace_bytes": memory.workspace_bytes,
                     "kv_blocks": memory.layout.num_blocks - 1,
                     "kv_tokens": memory.layout.usable_tokens,
                     "block_size": memory.layout.block_size, "max_len": limits.max_model_len,
                     "max_num_seqs": limits.max_num_seqs,
                     "max_prefill_tokens": limits.max_prefill_tokens}

    def generate(self, prompts, max_tokens):
        compiled = self.llm.compilations
        runner = self.llm.engine.runner
        before = dict(runner.timings)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, [greedy(n) for n in max_tokens])
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "token_ids": [o.token_ids for o in outputs],
                "new_compilations": self.llm.compilations - compiled,
                "compilations": self.llm.compilations,
                "graph_timings": {k: v - before[k] for k, v in runner.timings.items()},
                "preemptions": self.llm.engine.stats().num_preemptions}

    def warmup(self):
        start = time.perf_counter()
        graphs = self.llm.engine.warmup()
        return {"graphs": graphs, "seconds": time.perf_counter() - start,
                "compilations": self.llm.compilations,
                "shapes": len(self.llm.engine.runner.shapes())}

    def ttft(self, long_prompts, long_tokens, short_prompt, short_tokens, steps_before):
        """The long requests are added and stepped until every one of them is decoding, then
        `steps_before` more steps (each timed); then the short request is added and the engine
        stepped until it yields its first token: time to first token = add_request to that
        step's return. Then a few more steps are timed (decode of all), and everything is
        aborted. Also answers how many tokens the long requests still had to make when the
        short one arrived: what a static batch would make it wait for."""
        engine = self.llm.engine
        for i, prompt in enumerate(long_prompts):
            engine.add_request(f"long-{i}", prompt, greedy(long_tokens))
        made = {}
        start = time.perf_counter()
        while len(made) < len(long_prompts):  # every long request has its first token
            for out in engine.step():
                made[out.request_id] = len(out.token_ids)
        prefill_seconds = time.perf_counter() - start
        steps = []
        for _ in range(steps_before):
            t = time.perf_counter()
            for out in engine.step():
                made[out.request_id] = len(out.token_ids)
            steps.append(time.perf_counter() - t)
        remaining = long_tokens - min(made.values())
        added = time.perf_counter()
        engine.add_request("short", short_prompt, greedy(short_tokens))
        short_steps, first_token = [], None
        while first_token is None:
            t = time.perf_counter()
            outs = engine.step()
            short_steps.append(time.perf_counter() - t)
            if any(o.request_id == "short" and o.token_ids for o in outs):
                first_token = time.perf_counter() - added
        after = []
        for _ in range(steps_before):
            t = time.perf_counter()
            engine.step()
            after.append(time.perf_counter() - t)
        for i in range(len(long_prompts)):
            engine.abort_request(f"long-{i}")
        engine.abort_request("short")
        engine.step()  # collects the aborted outputs
        return {"first_token_seconds": first_token, "steps_to_first_token": len(short_steps),
                "step_seconds_with_short": short_steps,
                "decode_step_seconds_before": steps, "decode_step_seconds_after": after,
                "median_decode_step_seconds": statistics.median(steps),
                "long_prefill_seconds": prefill_seconds,
                "long_tokens_remaining": remaining,
                "static_batch_wait_estimate_seconds": remaining * statistics.median(steps)}


class HFSide:
    """Qwen2ForCausalLM in float32. Several prompts: transformers' continuous batching
    (`continuous_batching_context_manager`: a paged cache, requests added with their own
    max_new_tokens; the manager kept between calls, so its set-up and warm-up happen once);
    one prompt: `generate`. options: keyword arguments of ContinuousBatchingConfig (left to
    itself on CPU it sizes its cache from free memory: 14 GB for a small model here)."""

    def __init__(self, model_dir, options):
        import torch

        self.torch = torch
        self.model, self.load_seconds, self.versions = load_hf(model_dir)
        self.info = dict(options)
        self.cb_options = options

    def generate(self, prompts, max_tokens):
        with self.torch.inference_mode():
            start = time.perf_counter()
            if len(prompts) == 1:
                ids = self.torch.tensor(prompts)
                out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids),
                                          max_new_tokens=max_tokens[0], min_new_tokens=0)
                tokens = [out[0, ids.shape[1]:].tolist()]
            else:
                tokens = self._continuous(prompts, max_tokens)
            seconds = time.perf_counter() - start
        if any(len(t) != n for t, n in zip(tokens, max_tokens)):
            raise RuntimeError("HF made a different number of tokens than asked")
        return {"seconds": seconds, "token_ids": tokens}

    def _continuous(self, prompts, max_tokens):
        import copy

        from transformers import ContinuousBatchingConfig

        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens = max(max_tokens)
        with self.model.continuous_batching_context_manager(
                generation_config=config, block=True, timeout=5, persistent_manager=True,
                continuous_batching_config=ContinuousBatchingConfig(**self.cb_options)) \
                as manager:
            for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
            results = {}
            while len(results) < len(prompts):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result.generated_tokens
                elif result is None and not manager.is_running():
                    raise RuntimeError("HF's continuous batching thread stopped")
        return [list(results[f"r{i}"]) for i in range(len(prompts))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=("msinfer", "hf"))
    p.add_argument("--model", required=True)
    p.add_argument("--options", default="{}", help="JSON: keyword arguments of LLM(...)")
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args()
    baseline = rss_figures()["rss_bytes"]
    cls = {"msinfer": MsinferSide, "hf": HFSide}[args.side]
    side = cls(args.model, json.loads(args.options))
    serve(side, args.reply_fd, dict(load_seconds=side.load_seconds, versions=side.versions,
                                    info=side.info), baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
