"""`msinfer make-tiny-model`: a random-weight Qwen2 or Qwen3 checkpoint for tests and
benchmarks."""
import argparse

from .. import log
from ..tools.tiny_model import DTYPES, FAMILIES, SHAPE_PRESETS, make_tiny_model


def register(subparsers):
    p = subparsers.add_parser(
        "make-tiny-model", help="write a random Qwen2 or Qwen3 checkpoint (tests, benchmarks)",
        description="Write a Hugging Face Qwen2 (--family qwen3: Qwen3 dense) checkpoint with "
                    "random weights and a small trained tokenizer into a new directory.")
    p.add_argument("dir", help="output directory (must be new or empty)")
    p.add_argument("--preset", choices=sorted(SHAPE_PRESETS),
                   help="a published model's shape (flags given as well override it)")
    p.add_argument("--family", choices=sorted(FAMILIES),
                   help="model family (default qwen2; qwen3: q/k norms, no q/k/v bias)")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int, help="attention head size (default hidden / heads)")
    p.add_argument("--intermediate", type=int, help="default: 2.75 x hidden, multiple of 8")
    p.add_argument("--vocab", type=int)
    p.add_argument("--tie", action=argparse.BooleanOptionalAction,
                   help="tie lm_head to the embedding")
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--shards", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--config-style", choices=("4", "5"),
                   help="config.json as transformers 4.x or 5.x writes it (default 4)")
    p.add_argument("--max-position", type=int)
    p.set_defaults(func=_run_cli)


def cli_arguments(args):
    """make_tiny_model's keyword arguments: the preset's shape, then the flags given."""
    kwargs = dict(SHAPE_PRESETS[args.preset]) if args.preset else {}
    for key in ("family", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                "vocab", "tie", "dtype", "shards", "seed", "config_style", "max_position"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    return kwargs


def _run_cli(args):
    log.setup()
    meters = {}

    def progress(done, total, name):
        # A logged line every few seconds and at the end: readable on a terminal, in a pipe
        # and in a CI log alike (no carriage-return redraw per tensor).
        meters.setdefault("weights", log.Progress("writing weights", total)).step(done)

    config = make_tiny_model(args.dir, progress=progress, **cli_arguments(args))
    print(f"wrote {args.dir}: {config.model_type}, {config.num_layers} layers, "
          f"hidden {config.hidden_size}, "
          f"{config.num_parameters():,} parameters, {config.torch_dtype}")
    return 0
