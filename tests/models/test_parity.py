"""Single-device parity with Hugging Face transformers' Qwen2 and Qwen3 (torch, CPU, float32),
each family on its own checkpoints: Qwen2's made by msinfer's maker (grouped KV heads, tied
and untied, both config spellings, two shards, bfloat16), Qwen3's by transformers' own
classes (Qwen3Config, Qwen3ForCausalLM, save_pretrained: head_dim != hidden / heads, tied and
untied, bfloat16 on disk) with tools.tiny_model's random values (peaked, input-dependent
logits: transformers' own initialisation gives near-uniform ones, whose greedy choice is a
coin toss at 1e-4).

Each case runs msinfer's engine (paged KV cache, chunked prefill, continuous batching) on its
checkpoint; transformers runs the same files. The engine reports the
log-probabilities of the whole vocabulary at every generated token (SamplingParams.logprobs),
which must match transformers' log_softmax within 1e-4, and greedy tokens must be identical
(transformers' argmax at every position, teacher-forced on msinfer's tokens, which is exactly
greedy decoding by induction; every case also calls `generate`).

The engine's settings make every mechanism run inside these short prompts: KV blocks of 4
tokens, prefill chunks of 16 tokens (so a 37-token prompt takes three chunks, and short prompts
share a chunk), and a KV pool small enough to preempt in one test.
"""
import importlib
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from msinfer import LLM, SamplingParams  # noqa: E402
from msinfer.config import ModelConfig  # noqa: E402
from msinfer.tools.tiny_model import random_tensor  # noqa: E402

PROMPT_LENGTHS = (5, 11, 37, 1)
NEW_TOKENS = 32
TOLERANCE = 1e-4
ENGINE = dict(max_len=128, block_size=4, max_prefill_tokens=16, max_num_seqs=4,
              kv_cache_memory=1 << 20)

# Qwen2 checkpoints (conftest.tiny_checkpoint: made once per session;
# tests/parallel/test_distributed.py and tests/models/test_cpu_kernel_forms.py run on these too).
BASE = dict(layers=2, hidden=64, vocab=384, seed=1)
QWEN2_CASES = {
    # GQA (8 query heads over 2 KV heads), separate lm_head, transformers 4.x config keys.
    "gqa_untied_config4": dict(heads=8, kv_heads=2, tie=False, config_style="4"),
    # Tied embeddings, transformers 5.x config keys, weights sharded over 2 files + index.
    "tied_config5_two_shards": dict(heads=4, kv_heads=4, tie=True, config_style="5",
                                    shards=2),
    # A bfloat16 checkpoint, converted to float32 on load (CPU policy).
    "bfloat16_checkpoint": dict(heads=8, kv_heads=2, tie=False, dtype="bfloat16", layers=3),
}
# Qwen3 checkpoints (hf_checkpoint below; tests/parallel/test_distributed.py runs on these too).
QWEN3_CASES = {
    # 4 query heads of 32 over 2 KV heads: q is 128 wide over a hidden size of 64.
    "qwen3_untied": dict(heads=4, kv_heads=2, head_dim=32, tie=False),
    # Tied embeddings, 8 heads of 16 over 4 KV heads (q 128 wide over 64), three layers.
    "qwen3_tied": dict(heads=8, kv_heads=4, head_dim=16, tie=True, layers=3, seed=2),
}
ALL_CASES = sorted(QWEN2_CASES) + sorted(QWEN3_CASES)
# The engine's graphs per case: of dynamic shape (the default) but for one case run on graphs
# of static shape, one per call shape (--graph-shapes static)
GRAPH_SHAPES = {"tied_config5_two_shards": "static"}


def case_spec(name):
    """make_tiny_model's arguments for QWEN2_CASES[name]."""
    return {**BASE, **QWEN2_CASES[name]}


def prompts_for(vocab, seed=0, lengths=PROMPT_LENGTHS):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def greedy(vocab, max_tokens=NEW_TOKENS):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          logprobs=vocab)


def logprob_rows(out, vocab):
    """(generated tokens, vocab) array of the engine's reported log-probabilities."""
    rows = np.full((len(out.logprobs), vocab), np.nan)
    for i, step in enumerate(out.logprobs):
        rows[i, list(step)] = list(step.values())
    return rows


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()


def assert_matches_hf(hf, prompt, out, vocab, name=""):
    """Tokens identical to transformers' greedy choice; log-probs within TOLERANCE."""
    reference = hf_logprobs(hf, prompt + out.token_ids)
    # Position len(prompt)-1+k predicts generated token k.
    expected = reference[len(prompt) - 1:len(prompt) - 1 + len(out.token_ids)]
    assert out.token_ids == expected.argmax(-1).tolist(), name
    diff = np.abs(logprob_rows(out, vocab) - expected).max()
    assert diff < TOLERANCE, f"{name}: log-probs differ by {diff}"


HF_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def make_hf_checkpoint(path, family="qwen3", *, layers=2, hidden=64, heads=4, kv_heads=2,
                       head_dim=None, intermediate=176, vocab=384, tie=False, seed=1,
                       max_position=128, rope=None, config_style="5"):
    """A random checkpoint written by transformers' own classes, in bfloat16: `rope` adds to
    the rope parameters (e.g. yarn); config_style "4" rewrites config.json as released Qwen2.5
    checkpoints spell it (top-level rope_theta, rope_scaling with `type`). Returns the path."""
    config_class, model_class = (getattr(transformers, n) for n in HF_CLASSES[family])
    extra = {"head_dim": head_dim} if head_dim else {}
    config = config_class(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_position, tie_word_embeddings=tie, rms_norm_eps=1e-6,
        rope_parameters=dict({"rope_type": "default", "rope_theta": 1e6}, **(rope or {})),
        bos_token_id=0, eos_token_id=1, **extra)
    model = model_class(config)
    with torch.no_grad():  # a tied lm_head is the embedding: named_parameters lists it once
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(random_tensor(name, tuple(param.shape), seed)))
    model.to(torch.bfloat16).save_pretrained(path)
    if config_style == "4":
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            raw = json.load(f)
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        kind = params.pop("rope_type")
        params.pop("type", None)
        raw["rope_scaling"] = dict(params, type=kind) if kind != "default" else None
        raw["torch_dtype"] = raw.pop("dtype")
        with open(config_path, "w") as f:
            json.dump(raw, f, indent=2)
    return path


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, **make_hf_checkpoint arguments) -> (directory, ModelConfig,
    transformers' model on it in float32), made once per session per name."""
    made = {}

    def make(name, **spec):
        if name not in made:
            path = make_hf_checkpoint(str(tmp_path_factory.mktemp(name) / "model"), **spec)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32).eval()
            made[name] = (path, ModelConfig.from_model_dir(path), hf)
        return made[name]
    return make


@pytest.fixture(scope="module")
def case(request, tiny_checkpoint, hf_model, hf_checkpoint):
    """(name, ModelConfig, LLM, transformers' model) of the case the test is parametrized with
    (every_case, qwen2_cases, qwen3_cases): one engine per case and module."""
    name = request.param
    if name in QWEN3_CASES:
        model_dir, config, hf = hf_checkpoint(name, **QWEN3_CASES[name])
    else:
        model_dir, config = tiny_checkpoint(**case_spec(name))
        hf = hf_model(model_dir)
    llm = LLM(model_dir, **ENGINE, graph_shapes=GRAPH_SHAPES.get(name))
    assert llm.engine.runner.graph_of.dynamic == (name not in GRAPH_SHAPES)
    return name, config, llm, hf


every_case = pytest.mark.parametrize("case", ALL_CASES, indirect=True)
qwen2_cases = pytest.mark.parametrize("case", sorted(QWEN2_CASES), indirect=True)
qwen3_cases = pytest.mark.parametrize("case", sorted(QWEN3_CASES), indirect=True)


@qwen3_cases
def test_checkpoints_are_transformers_qwen3_with_head_dim_apart_from_hidden(case):
    name, config, llm, hf = case
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert config.model_type == "qwen3" and config.torch_dtype == "bfloat16"
    assert config.num_heads * config.head_dim != config.hidden_size
    assert config.head_dim == hf.config.head_dim
    layer = hf.model.layers[0].self_attn
    assert layer.q_proj.bias is None and tuple(layer.q_norm.weight.shape) == (config.head_dim,)
    assert config.tie_word_embeddings == (name == "qwen3_tied")


@every_case
def test_logprobs_and_32_greedy_tokens_match_transformers(case):
    """Prompts of 5, 11, 37 (three chunks, ten blocks) and 1 token (straight to decode)."""
    name, config, llm, hf = case
    prompts = prompts_for(config.vocab_size)
    outs = llm.generate(prompts, greedy(config.vocab_size))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert len(out.token_ids) == NEW_TOKENS and out.finish_reason == "length"
        assert_matches_hf(hf, prompt, out, config.vocab_size, f"{name} prompt {i}")
    assert llm.engine.stats().num_blocks_used == 0  # every block back once all finished


@every_case
def test_transformers_generate_gives_the_same_tokens(case):
    name, config, llm, hf = case
    prompt = prompts_for(config.vocab_size, seed=5)[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                ignore_eos=True))[0]
    ids = torch.tensor([prompt])
    # the mask given: a prompt token equal to pad_token_id would otherwise be masked out
    hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == hf_out[0, len(prompt):].tolist()
    assert out.finish_reason == "length"


@qwen3_cases
def test_the_engine_holds_the_norms_whole_and_qkv_without_bias(case):
    name, config, llm, hf = case
    runner = llm.engine.runner
    names = runner.family.layer_weight_names(0)
    assert runner.family.__name__ == "msinfer.models.qwen3"
    assert not [n for n in names if n.endswith(".bias")]
    held = dict(zip(names, runner.layer_weights[0]))
    for norm in ("q_norm", "k_norm"):
        weight = held[f"model.layers.0.self_attn.{norm}.weight"]
        expected = getattr(hf.model.layers[0].self_attn, norm).weight.detach().numpy()
        np.testing.assert_array_equal(weight.asnumpy(), expected)


@qwen2_cases
def test_request_added_while_others_decode_and_an_abort_frees_its_blocks(case):
    name, config, llm, hf = case
    engine, vocab = llm.engine, config.vocab_size
    first, second, dropped = prompts_for(vocab, seed=7, lengths=(9, 30, 6))
    engine.add_request("first", first, greedy(vocab, 20))
    engine.add_request("dropped", dropped, greedy(vocab, 20))
    finished = {}
    for _ in range(4):
        for out in engine.step():
            assert not out.finished
    assert engine.stats().num_running == 2
    used = engine.stats().num_blocks_used
    engine.abort_request("dropped")
    assert engine.stats().num_blocks_used < used  # freed at once
    engine.abort_request("never-added")  # a warning, not an error
    engine.add_request("second", second, greedy(vocab, 20))  # arrives mid-decode
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["dropped"].finish_reason == "abort"
    assert 0 < len(finished["dropped"].token_ids) < 20
    assert_matches_hf(hf, first, finished["first"], vocab, "first")
    assert_matches_hf(hf, second, finished["second"], vocab, "second")
    assert engine.stats().num_blocks_used == 0


@qwen2_cases
def test_prompts_of_other_lengths_in_the_same_buckets_compile_no_new_graph(case):
    name, config, llm, hf = case
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([[7, 8, 9]], params)
    compiled = llm.compilations
    for length in (4, 6, 9, 12, 16):  # one 16-token chunk, contexts below 64
        llm.generate([list(range(1, length + 1))], params)
    assert llm.compilations == compiled


def test_layers_run_in_stacks_of_any_size_give_the_same_tokens(tiny_checkpoint, hf_model):
    """A graph runs k consecutive layers, k set by the workspace and the calls a pass may
    take (planning/workspace.py): one, two or all four layers per graph must all be Qwen2
    (each layer's own weights and own cache). Static graphs, which ask `layers_for` at
    every call (dynamic ones ask once, for their fewest and most)."""
    model_dir, config = tiny_checkpoint(layers=4, hidden=64, heads=8, kv_heads=2, vocab=384,
                                        seed=4)
    llm = LLM(model_dir, **ENGINE, graph_shapes="static")
    runner = llm.engine.runner
    hf = hf_model(model_dir)
    prompts = prompts_for(config.vocab_size, seed=5, lengths=(23, 6))
    for count in (1, 2, 4):
        runner.graph_of.layers_for = lambda tokens, groups, context, count=count: count
        for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, greedy(384, 6)))):
            assert_matches_hf(hf, prompt, out, config.vocab_size, f"{count}: prompt {i}")
    stacks = {graph: cell for graph, cell in runner.cells.items() if graph.part == "layers"}
    assert sorted({graph.layers for graph in stacks}) == [1, 2, 4]
    # One Cell per position: a Cell called several times over Tensor caches it updates makes
    # MindSpore copy every cache at every call (model.LayerStack).
    assert all(len({id(layer) for layer in cell.layers}) == graph.layers
               for graph, cell in stacks.items())


def test_preempted_requests_are_recomputed_exactly(tiny_checkpoint, hf_model):
    """A KV pool of 12 blocks of 4 tokens (48 tokens) for three requests that grow to 34-40
    tokens each, two at a time (max_num_seqs 2: no batch-4 graphs to compile): the scheduler
    preempts and later recomputes, and every token is still transformers' greedy token."""
    model_dir, config = tiny_checkpoint(**case_spec("gqa_untied_config4"))
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (2, 2, 8)
    per_block = 2 * 2 * 4 * 2 * 8 * 4  # K and V x layers x block x KV heads x head_dim x fp32
    llm = LLM(model_dir, **dict(ENGINE, kv_cache_memory=13 * per_block, max_len=48,
                                max_num_seqs=2))
    assert llm.engine.layout.num_blocks == 13  # one reserved
    hf = hf_model(model_dir)
    prompts = prompts_for(config.vocab_size, seed=3, lengths=(10, 14, 8))
    outs = llm.generate(prompts, greedy(config.vocab_size, 26))
    assert llm.engine.stats().num_preemptions > 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_matches_hf(hf, prompt, out, config.vocab_size, f"prompt {i}")


@pytest.mark.parametrize("family, tensor, data", [("qwen2", 4, 1), ("qwen2", 2, 2),
                                                   ("qwen3", 4, 1)])
def test_semi_auto_model_with_tp4_shard_annotations_matches_hf_standalone(
        tiny_checkpoint, hf_model, hf_checkpoint, family, tensor, data):
    """The semi_auto model (one graph, full-shape Parameters, shard() from the plan) runs
    stand-alone, where MindSpore ignores shard(): it must still be its family, Qwen3's q/k
    norms included. Its Parameters hold what the ranks of a real job would hold side by side:
    a fused q/k/v (gate/up) weight is the ranks' [q_r; k_r; v_r] blocks one after the other,
    which the model reads per rank block."""
    import mindspore as ms

    from msinfer.engine import LLMEngine
    from msinfer.engine.model_runner import SemiAutoRunner
    from msinfer.engine_config import EngineConfig, EngineLimits
    from msinfer.layers.parallel_context import ParallelContext
    from msinfer.models.loader import Checkpoint
    from msinfer.parallel.distributed import set_graph_mode
    from msinfer.parallel.strategy import Strategy, checkpoint_parts
    from msinfer.planning.kv_layout import CacheLayout

    if family == "qwen3":
        model_dir, config, hf = hf_checkpoint("qwen3_tied", **QWEN3_CASES["qwen3_tied"])
    else:
        model_dir, config = tiny_checkpoint(layers=2, hidden=64, heads=8, kv_heads=4,
                                            vocab=384, tie=True, seed=4)
        hf = hf_model(model_dir)
    models = importlib.import_module(f"msinfer.models.{family}")
    plan = Strategy.default(tensor=tensor, data=data, parallel_mode="semi_auto").resolve(config)
    set_graph_mode("CPU")
    ctx = ParallelContext(config=config, plan=plan, mode="semi_auto", dtype=ms.float32)
    layout = CacheLayout(config.num_layers, plan.local_kv_heads, config.head_dim,
                         block_size=4, num_blocks=64, dtype_bytes=4)
    shapes = config.parameter_shapes()
    names = models.weight_names(config)
    checkpoint = Checkpoint(model_dir)

    def rank_parts(rank):
        return lambda n: [(p, plan.slices(p, rank), shapes[p]) for p in checkpoint_parts(n)]

    ranks = [dict(checkpoint.load(names, rank_parts(r), np.float32)) for r in range(tensor)]
    whole = dict(checkpoint.load(names, lambda n: [(p, tuple(slice(0, s) for s in shapes[p]),
                                                    shapes[p]) for p in checkpoint_parts(n)],
                                 np.float32))
    full = {name: (np.concatenate([r[name] for r in ranks])
                   if len(checkpoint_parts(name)) > 1 else whole[name]) for name in names}
    assert full["model.embed_tokens.weight"].shape == (config.vocab_size, config.hidden_size)
    model = models.Model(ctx, layout, {n: a.shape for n, a in full.items()})
    assert model.head.lm_head.matmul.in_strategy == ((data, 1), (tensor, 1))
    assert model.layers[0].self_attn.o_proj.matmul.in_strategy == ((data, tensor), (1, tensor))
    assert model.k_caches[0].shape == (layout.num_slots, config.num_kv_heads, config.head_dim)
    if family == "qwen3":
        assert model.layers[0].q_norm.to_float.in_strategy == ((1, tensor, 1),)
    for name, array in full.items():
        model.weights[name].set_data(ms.Tensor(array))
    limits = EngineLimits(max_num_seqs=4, max_prefill_tokens=16, max_model_len=128)
    runner = SemiAutoRunner(ctx, layout, limits, model=model)
    assert all(b % data == 0 for b in runner.batch_buckets + runner.chunk_buckets)
    engine = LLMEngine(runner, layout, EngineConfig(model=str(model_dir), model_config=config,
                                                    limits=limits), eos_token_ids=(), seed=0)
    prompts = prompts_for(config.vocab_size, seed=9)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(config.vocab_size, 12))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    for i, prompt in enumerate(prompts):
        assert_matches_hf(hf, prompt, finished[str(i)], config.vocab_size, f"prompt {i}")


def test_float16_compute_the_310p_path_stays_close_to_float32_transformers(tiny_checkpoint,
                                                                           hf_model):
    """310P runs float16: the same model in float16 (on CPU here) keeps transformers'
    float32 distribution within float16's precision, and the argmax of each step."""
    model_dir, config = tiny_checkpoint(**case_spec("bfloat16_checkpoint"))
    llm = LLM(model_dir, dtype="float16", **ENGINE)
    assert llm.engine.runner.head_weights[1].dtype == __import__("mindspore").float16
    hf = hf_model(model_dir)
    prompts = prompts_for(config.vocab_size, seed=13)
    outs = llm.generate(prompts, greedy(config.vocab_size, 4))
    for prompt, out in zip(prompts, outs):
        expected = hf_logprobs(hf, prompt + out.token_ids)[len(prompt) - 1:][:4]
        ours = logprob_rows(out, config.vocab_size)
        assert np.abs(ours - expected).max() < 0.05
        assert (ours.argmax(-1) == expected.argmax(-1)).all()


@qwen2_cases
def test_on_cpu_the_layer_projections_are_held_as_this_processors_forms_say(case):
    """The layouts the parity above runs with: explicit mode on CPU keeps q/k/v, o, gate/up
    and down transposed to (in, out) where hardware.cpu_matmul_forms says x @ W is fastest,
    else as the checkpoint stores them; the lm_head (the embedding when tied) as stored."""
    from msinfer.hardware import cpu_matmul_forms

    name, config, llm, hf = case
    runner = llm.engine.runner
    hidden, d = config.hidden_size, config.head_dim
    qkv_out = (config.num_heads + 2 * config.num_kv_heads) * d
    expected = [(hidden, qkv_out), (config.num_heads * d, hidden),
                (hidden, 2 * config.intermediate_size), (config.intermediate_size, hidden)]
    if not cpu_matmul_forms().in_out:
        expected = [shape[::-1] for shape in expected]
    shapes = [tuple(w.shape) for w in runner.layer_weights[0]]
    assert [shapes[1], shapes[3], shapes[5], shapes[6]] == expected  # qkv, o, gate_up, down
    assert tuple(runner.head_weights[1].shape) == (config.vocab_size, hidden)


@qwen2_cases
def test_the_planner_counts_the_bytes_the_engine_allocates(case):
    """Planner = engine: the weights and KV cache the plan reports for this rank are the bytes
    of the tensors the engine holds; the engine's pool has the plan's block count."""
    from msinfer.planning.planner import make_plan

    name, config, llm, hf = case
    report = make_plan(config, llm.strategy, llm.profile, llm.limits)
    runner = llm.engine.runner
    weights = {id(w): w for w in [runner.embed_weight, *runner.head_weights]
               + [w for layer in runner.layer_weights for w in layer]}
    held = sum(w.nbytes for w in weights.values())
    assert report.devices[0].weights_bytes == held
    assert report.devices[0].kv_cache_bytes == runner.cache_bytes
    assert report.kv_blocks == llm.engine.blocks.num_usable
