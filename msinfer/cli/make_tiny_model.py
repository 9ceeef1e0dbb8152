"""`msinfer make-tiny-model`: a random-weight Qwen2 or Qwen3 checkpoint (dense, or MoE with
--moe) for tests and benchmarks; with --copying a Qwen2 that copies spans of its context
(for speculative decoding)."""
import argparse

from .. import log
from ..errors import MsinferError
from ..tools.tiny_model import (COPYING_SHAPE, DTYPES, FAMILIES, MOE_DEFAULTS, SHAPE_PRESETS,
                                make_tiny_model)


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
    p.add_argument("--rope-theta", type=float,
                   help="rotary base (default 1e6, Qwen2's; 1e8 with --copying)")
    p.add_argument("--copying", action="store_true",
                   help="weights that copy spans of the context (an induction circuit, not "
                        "random): n-gram and draft proposals are accepted on it. Default "
                        "shape: 2 layers, hidden 256, heads 4 over 2 KV heads, vocab 2048; "
                        "a target for a draft is the same with more --layers and the same "
                        "--seed")
    moe = p.add_argument_group("mixture of experts (--moe qwen3: Qwen3-MoE, qwen2: Qwen2-MoE)")
    moe.add_argument("--moe", choices=sorted(FAMILIES),
                     help="a MoE model of this family (sets --family)")
    moe.add_argument("--experts", type=int, help="routed experts per sparse layer (default 8)")
    moe.add_argument("--top-k", type=int, help="experts per token (default 2)")
    moe.add_argument("--moe-intermediate", type=int, help="one expert's width (hidden / 2)")
    moe.add_argument("--shared-expert-intermediate", type=int,
                     help="Qwen2-MoE's shared expert width (4 x --moe-intermediate)")
    moe.add_argument("--mlp-only-layers", help="dense layers, e.g. 1,3")
    moe.add_argument("--decoder-sparse-step", type=int, help="every n-th layer sparse (1)")
    moe.add_argument("--norm-topk-prob", action=argparse.BooleanOptionalAction,
                     help="renormalise the top-k weights (default: Qwen3-MoE yes, Qwen2-MoE no)")
    p.set_defaults(func=_run_cli)


def cli_arguments(args):
    """make_tiny_model's keyword arguments: the preset's shape, then the flags given."""
    if args.preset:
        kwargs = dict(SHAPE_PRESETS[args.preset])
    else:
        kwargs = dict(COPYING_SHAPE) if args.copying else {}
    if args.copying:
        kwargs["copying"] = True
    for key in ("family", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                "vocab", "tie", "dtype", "shards", "seed", "config_style", "max_position",
                "rope_theta"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    moe_keys = [k for k in MOE_DEFAULTS if getattr(args, k) is not None]
    if args.moe is None and moe_keys:
        raise MsinferError(f"make-tiny-model: --{moe_keys[0].replace('_', '-')} needs --moe")
    if args.moe is not None:
        kwargs["family"] = args.moe
        kwargs["moe"] = {k: getattr(args, k) for k in moe_keys}
        if args.mlp_only_layers is not None:
            try:
                kwargs["moe"]["mlp_only_layers"] = tuple(
                    int(n) for n in args.mlp_only_layers.split(",") if n.strip())
            except ValueError:
                raise MsinferError(f"make-tiny-model: --mlp-only-layers "
                                   f"{args.mlp_only_layers!r}: layer numbers, e.g. 1,3") from None
    return kwargs


def _run_cli(args):
    log.setup()
    meters = {}

    def progress(done, total, name):
        # A logged line every few seconds and at the end: readable on a terminal, in a pipe
        # and in a CI log alike (no carriage-return redraw per tensor).
        meters.setdefault("weights", log.Progress("writing weights", total)).step(done)

    config = make_tiny_model(args.dir, progress=progress, **cli_arguments(args))
    kind = "copying " if args.copying else ""
    print(f"wrote {args.dir}: {kind}{config.model_type}, {config.num_layers} layers, "
          f"hidden {config.hidden_size}, "
          f"{config.num_parameters():,} parameters, {config.torch_dtype}")
    return 0
