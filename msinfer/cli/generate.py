"""`msinfer generate`: run prompts through a checkpoint, on one device or as one rank of many.

Every rank of a sharded job runs this same command; only rank 0 prints the results.
"""
import json
import sys

from ..errors import MsinferError
from ..parallel.strategy import PARALLEL_MODES
from .args import add_engine_arguments, add_hardware_argument


def register(subparsers):
    p = subparsers.add_parser(
        "generate", help="generate text from prompts",
        description="Generate from a Hugging Face Qwen2 checkpoint. Under mpirun/msrun every "
                    "rank runs this command; rank 0 prints.")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each --prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--strategy", default=None, help="strategy YAML (default: one device)")
    add_hardware_argument(p)
    p.add_argument("--parallel-mode", choices=PARALLEL_MODES, default=None,
                   help="default: the strategy's parallel_mode, else explicit")
    add_engine_arguments(p)
    p.add_argument("--dtype", default=None, help="compute dtype override")
    p.add_argument("--rank-table", default=None, help="HCCL rank table (Ascend rank-table mode)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt: prompt, token_ids, text")
    p.set_defaults(func=run)


def _parse_ids(text):
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise MsinferError(f"--prompt-ids {text!r}: expected comma-separated integers") from None


def run(args):
    from ..api import LLM
    from ..engine.sampling import SamplingParams

    if not args.prompt and not args.prompt_ids:
        raise MsinferError("give at least one --prompt or --prompt-ids")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    llm = LLM(args.model, strategy=args.strategy, hardware=args.hardware,
              parallel_mode=args.parallel_mode, max_len=args.max_len, dtype=args.dtype,
              rank_table=args.rank_table, kv_cache_memory=args.kv_cache_memory,
              block_size=args.block_size, max_prefill_tokens=args.max_prefill_tokens,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.prefix_caching,
              graph_shapes=args.graph_shapes, quantization=args.quantization)
    prompts = list(args.prompt)
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in prompts]
    prompts += [_parse_ids(ids) for ids in args.prompt_ids]
    outputs = llm.generate(prompts, params)
    if llm.dist.rank != 0:
        return 0
    shown = list(args.prompt) + [None] * len(args.prompt_ids)
    for shown_prompt, out in zip(shown, outputs):
        if args.json:
            print(json.dumps({"prompt": shown_prompt if shown_prompt is not None
                              else out.prompt_token_ids,
                              "token_ids": out.token_ids, "text": out.text,
                              "finish_reason": out.finish_reason}), flush=True)
        else:
            label = shown_prompt if shown_prompt is not None else out.prompt_token_ids
            print(f"prompt: {label!r}\ncompletion: {out.text!r}\ntoken_ids: {out.token_ids}\n",
                  flush=True)
    sys.stdout.flush()
    return 0
