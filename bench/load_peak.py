"""Where the new engine's peak resident memory comes from: loading or running.

    python bench/load_peak.py [--model models/qwen2-1.5b-shape] [--prompt 1000]

Builds LLM(model) with default settings, prints RSS and peak RSS (VmHWM) right after
loading, next to what the engine allocates (weights, KV pool, workspace), then runs one
random-id prompt for 8 greedy tokens and prints the peak again.

--drain tries the loader fix this points at: `Checkpoint.load` returns every weight as a
float32 numpy array at once and `LLM` then copies each into a MindSpore Tensor while that
dict is alive, so loading holds the weights twice. With --drain the dict hands each array
over and forgets it as LLM converts it (a stand-in for converting as they are read).
"""
import argparse
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

from side_worker import rss_figures  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(os.path.dirname(BENCH), "models",
                                                   "qwen2-1.5b-shape"))
    p.add_argument("--prompt", type=int, default=1000, help="prompt tokens (0: load only)")
    p.add_argument("--drain", action="store_true",
                   help="free each host array as soon as LLM has converted it")
    args = p.parse_args(argv)
    if args.drain:
        from msinfer.models import loader as weights

        class Draining(dict):
            def items(self):
                while self:
                    name = next(iter(self))
                    yield name, self.pop(name)

        load = weights.Checkpoint.load
        weights.Checkpoint.load = lambda self, *a, **k: Draining(load(self, *a, **k))
    import numpy as np

    from msinfer import LLM
    from msinfer.engine.sampling import SamplingParams

    before = rss_figures()
    llm = LLM(args.model)
    loaded = rss_figures()
    m = llm.memory
    gb = 1e9
    print(f"before loading: RSS {before['rss_bytes'] / gb:.2f} GB")
    print(f"after LLM(): RSS {loaded['rss_bytes'] / gb:.2f} GB, peak {loaded['peak_rss_bytes'] / gb:.2f}"
          f" GB; engine allocations: weights {m.weights_bytes / gb:.2f} GB, KV pool "
          f"{m.kv_cache_bytes / gb:.2f} GB, workspace {m.workspace_bytes / gb:.2f} GB")
    if args.prompt:
        prompt = np.random.default_rng(0).integers(0, llm.config.vocab_size, args.prompt)
        llm.generate([prompt.tolist()], SamplingParams(max_tokens=8, temperature=0,
                                                        ignore_eos=True))
        after = rss_figures()
        print(f"after a {args.prompt}-token prompt: RSS {after['rss_bytes'] / gb:.2f} GB, peak "
              f"{after['peak_rss_bytes'] / gb:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
