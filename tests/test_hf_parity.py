"""Single-device parity with Hugging Face transformers' Qwen2 (torch, CPU, float32).

Each case makes a tiny random checkpoint, runs msinfer's compiled prefill/decode graphs on a
batch of three prompts of different lengths, and compares against transformers run on the
same files: logits after prefill and after each of 8 decode steps within 1e-4, and 32 greedy
tokens identical (transformers' argmax at every position, teacher-forced on msinfer's tokens,
which is exactly greedy decoding by induction; one case also calls `generate`).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from msinfer import LLM, SamplingParams  # noqa: E402
from msinfer.engine import Sequence  # noqa: E402
from msinfer.tiny_model import make_tiny_model  # noqa: E402

PROMPT_LENGTHS = (5, 11, 23)
NEW_TOKENS = 32
CHECKED_DECODE_STEPS = 8
TOLERANCE = 1e-4

CASES = {
    # GQA (8 query heads over 2 KV heads), separate lm_head, transformers 4.x config keys.
    "gqa_untied_config4": dict(heads=8, kv_heads=2, tie=False, config_style="4"),
    # Tied embeddings, transformers 5.x config keys, weights sharded over 2 files + index.
    "tied_config5_two_shards": dict(heads=4, kv_heads=4, tie=True, config_style="5",
                                    shards=2),
    # A bfloat16 checkpoint, converted to float32 on load (CPU policy).
    "bfloat16_checkpoint": dict(heads=8, kv_heads=2, tie=False, dtype="bfloat16", layers=3),
}


def prompts_for(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    spec = dict(layers=2, hidden=64, vocab=384, seed=1)
    spec.update(CASES[request.param])
    model_dir = tmp_path_factory.mktemp(request.param)
    config = make_tiny_model(str(model_dir), **spec)
    llm = LLM(str(model_dir), max_batch=4, max_len=128)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return request.param, config, llm, hf.eval()


def run_greedy_capturing_logits(engine, prompts):
    seqs = [Sequence(list(p), NEW_TOKENS) for p in prompts]
    steps = []

    def next_tokens(rows, logits):
        steps.append((list(rows), logits.copy()))
        return logits.argmax(-1)

    engine.generate(seqs, next_tokens, lambda row, seq: None)
    return seqs, steps


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_logits_and_32_greedy_tokens_match_transformers(case):
    name, config, llm, hf = case
    prompts = prompts_for(config.vocab_size)
    seqs, steps = run_greedy_capturing_logits(llm.engine, prompts)
    for row, (prompt, seq) in enumerate(zip(prompts, seqs)):
        assert len(seq.generated) == NEW_TOKENS
        reference = hf_logits(hf, prompt + seq.generated)
        # Position len(prompt)-1+k predicts generated token k.
        expected = reference[len(prompt) - 1:len(prompt) - 1 + NEW_TOKENS]
        ours = np.stack([logits[rows.index(row)] for rows, logits in steps])
        checked = 1 + CHECKED_DECODE_STEPS
        diff = np.abs(ours[:checked] - expected[:checked]).max()
        assert diff < TOLERANCE, f"{name} prompt {row}: logits differ by {diff}"
        assert seq.generated == expected.argmax(-1).tolist(), f"{name} prompt {row}"


def test_transformers_generate_gives_the_same_tokens(case):
    name, config, llm, hf = case
    prompt = prompts_for(config.vocab_size, seed=5)[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                ignore_eos=True))[0]
    hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert out.token_ids == hf_out[0, len(prompt):].tolist()
    assert out.finish_reason == "length"


def test_prompts_of_five_lengths_in_one_bucket_compile_no_new_graph(case):
    name, config, llm, hf = case
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([[7, 8, 9]], params)
    compiled = llm.compilations
    assert compiled >= 2  # at least one prefill and one decode graph
    for length in (4, 6, 9, 12, 16):
        llm.generate([list(range(1, length + 1))], params)
    assert llm.compilations == compiled
    # A longer prompt lands in the next bucket: exactly one more prefill graph.
    llm.generate([list(range(1, 30))], params)
    assert llm.compilations == compiled + 1


def test_semi_auto_model_with_tp4_shard_annotations_matches_hf_standalone(tmp_path):
    """The semi_auto model (full-shape parameters, shard() on every primitive from the tp4
    plan) runs stand-alone, where MindSpore ignores shard(): it must still be Qwen2."""
    import mindspore as ms

    from msinfer.distributed import set_graph_mode
    from msinfer.engine import Engine
    from msinfer.parallel_layers import ParallelContext, checkpoint_parameters
    from msinfer.model import Qwen2ForCausalLM
    from msinfer.strategy import Strategy
    from msinfer.weights import Checkpoint

    config = make_tiny_model(str(tmp_path), layers=2, hidden=64, heads=4, kv_heads=4,
                             vocab=384, tie=True, seed=4)
    plan = Strategy.default(tensor=4, parallel_mode="semi_auto").resolve(config)
    set_graph_mode("CPU")
    ctx = ParallelContext(config=config, plan=plan, mode="semi_auto", dtype=ms.float32)
    model = Qwen2ForCausalLM(config, ctx, max_batch=4, max_len=128)
    assert model.lm_head.matmul.in_strategy == ((1, 1), (4, 1))
    assert model.layers[0].self_attn.o_proj.matmul.in_strategy == ((1, 4), (1, 4))
    shapes = config.parameter_shapes()
    Checkpoint(str(tmp_path)).load_into(
        checkpoint_parameters(model),
        lambda name: (tuple(slice(0, n) for n in shapes[name]), shapes[name]))
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    prompts = prompts_for(config.vocab_size, seed=9)
    seqs, steps = run_greedy_capturing_logits(Engine(model, 4, 128), prompts)
    for row, (prompt, seq) in enumerate(zip(prompts, seqs)):
        expected = hf_logits(hf.eval(), prompt + seq.generated)[len(prompt) - 1:][:NEW_TOKENS]
        assert seq.generated == expected.argmax(-1).tolist()
        assert np.abs(steps[0][1][row] - expected[0]).max() < TOLERANCE


def test_prefill_split_into_single_row_calls_gives_the_same_logits(case):
    """A token budget of one padded prompt per call: each row is prefilled alone into its own
    cache row, and decoding the batch together still matches transformers."""
    name, config, llm, hf = case
    prompts = prompts_for(config.vocab_size, seed=11)
    budget = llm.engine.max_prefill_tokens
    llm.engine.max_prefill_tokens = 32  # the 23-token prompt pads to 32: one row per call
    try:
        seqs, steps = run_greedy_capturing_logits(llm.engine, prompts)
    finally:
        llm.engine.max_prefill_tokens = budget
    for row, (prompt, seq) in enumerate(zip(prompts, seqs)):
        expected = hf_logits(hf, prompt + seq.generated)[len(prompt) - 1:][:NEW_TOKENS]
        assert seq.generated == expected.argmax(-1).tolist()
        ours = np.stack([logits[rows.index(row)] for rows, logits in steps[:3]])
        assert np.abs(ours - expected[:3]).max() < TOLERANCE


def test_float16_compute_the_310p_path_stays_close_to_float32_transformers(tmp_path):
    """310P runs float16: the same model in float16 (on CPU here) keeps transformers'
    float32 logits within float16's precision, and the argmax of each step."""
    config = make_tiny_model(str(tmp_path), layers=2, hidden=64, heads=8, kv_heads=2,
                             vocab=384, seed=6, dtype="bfloat16")
    llm = LLM(str(tmp_path), max_batch=4, max_len=64, dtype="float16")
    assert llm.model.lm_head.weight.dtype == __import__("mindspore").float16
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    prompts = prompts_for(config.vocab_size, seed=13)
    seqs, steps = run_greedy_capturing_logits(llm.engine, prompts)
    for row, (prompt, seq) in enumerate(zip(prompts, seqs)):
        expected = hf_logits(hf.eval(), prompt + seq.generated)[len(prompt) - 1:][:NEW_TOKENS]
        ours = np.stack([logits[rows.index(row)] for rows, logits in steps[:4]])
        assert np.abs(ours - expected[:4]).max() < 0.05
        assert (ours.argmax(-1) == expected[:4].argmax(-1)).all()
