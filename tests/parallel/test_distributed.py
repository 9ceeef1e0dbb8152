"""Real multi-process jobs on CPU: tensor parallelism through MindSpore's collectives.

Two jobs of tests/distributed_worker.py, each started once as a subprocess and checked for many
things. The 4-rank job under mpirun runs four checkpoints one after the other: two data
replicas of two tensor ranks (dp2 x tp2), where every rank returns every output exactly as the
replica that ran it computed it; then tp4 on a Qwen2 whose 2 KV heads are replicated and on a
tied Qwen3; then dp2 x tp2 again on a Qwen2 with yarn rope scaling. The 2-rank job under msrun
runs a tied Qwen2 weight first and an untied Qwen3 with graphs of static shape. Every rank
agrees, log-probabilities match transformers within 1e-4, greedy tokens are identical, each
rank holds only its slice. Once their results are written, each job loses a rank (the worker's
test hooks: under mpirun one is killed, under msrun one fails with a user error) while the
others wait in a collective, and the job must come down quickly and non-zero. Jobs run in their
own process group and are killed on timeout, so no rank outlives a test.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_parity import QWEN3_CASES, case_spec  # noqa: E402
from test_parity import hf_checkpoint  # noqa: E402,F401  (the session fixture)
from test_yarn import YARN_CASE  # noqa: E402

from msinfer.parallel.distributed import free_port  # noqa: E402

pytestmark = pytest.mark.multirank  # 4 ranks, but for the tp2 job's tests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "distributed_worker.py")
STRATEGIES = os.path.join(ROOT, "strategies")
PROMPTS = [[5, 17, 42, 7, 99], [8, 9], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110],
           list(range(200, 240))]  # the last spans three 16-token prefill chunks
NEW_TOKENS = 32
JOB_TIMEOUT = 300
# From the moment a rank dies or fails to the moment its whole job is down (tens of times what
# either launcher takes on a quiet machine; a job that hangs instead reaches JOB_TIMEOUT).
DOWN_WITHIN = 60


@pytest.fixture(scope="module")
def models(tiny_checkpoint, hf_model, hf_checkpoint):
    """Two of test_parity's Qwen2 checkpoints: GQA with 2 KV heads (replicated at tp4), and a
    tied one in two files; its two Qwen3 (tied: 8 heads of 16 over 4 KV heads;
    untied: 4 heads of 32 over 2; hidden 64, bfloat16, written by transformers); and
    test_yarn's Qwen2 with yarn over an original context of 32 positions."""
    made = {}
    for name, case in {"gqa": "gqa_untied_config4", "tied": "tied_config5_two_shards"}.items():
        path, _ = tiny_checkpoint(**case_spec(case))
        made[name] = (path, hf_model(path))
    for name in ("qwen3_tied", "qwen3_untied"):
        path, _, hf = hf_checkpoint(name, **QWEN3_CASES[name])
        made[name] = (path, hf)
    path, _, hf = hf_checkpoint("qwen2_yarn", **YARN_CASE)
    made["yarn"] = (path, hf)
    return made


def mpirun_prefix(nproc):
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun is required (Debian: openmpi-bin); .ci/run installs it"
    cmd = [mpirun, "-n", str(nproc), "--bind-to", "none", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def msrun_prefix(nproc, log_dir):
    port = free_port()
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    return [msrun, f"--worker_num={nproc}", f"--local_worker_num={nproc}",
            f"--master_port={port}", f"--log_dir={log_dir}", "--join=True",
            "--cluster_time_out=120"]


def run_job(cmd, env=None, timeout=JOB_TIMEOUT):
    """Runs a job in its own process group; returns (exit code, output, seconds). A job still
    running after `timeout` seconds fails the test."""
    # MindSpore's workers retry joining the scheduler every 3-5 s by default and rank 0 starts
    # it once MindSpore is imported: each job waited one retry (test_commtest's FAST_JOIN)
    env = dict(os.environ, PYTHONUNBUFFERED="1", GLOG_v="3", MS_RETRY_INTERVAL_LOWER="1",
               MS_RETRY_INTERVAL_UPPER="1", **(env or {}))
    # msrun starts the workers with the `python` on PATH: make that this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"job did not finish in {timeout}s: {' '.join(cmd)}\n{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything a rank left behind
        except ProcessLookupError:
            pass
    return proc.returncode, out, time.monotonic() - start


def worker_args(model_dir, strategy, out_dir):
    """The worker script and its arguments (msrun starts the interpreter itself)."""
    return [WORKER, "--model", model_dir,
            "--strategy", os.path.join(STRATEGIES, strategy), "--out", str(out_dir),
            "--prompts", json.dumps(PROMPTS), "--new-tokens", str(NEW_TOKENS)]


def hf_reference(hf, prompt, generated):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0]
    end = len(prompt) - 1 + len(generated)
    return torch.log_softmax(logits, -1).numpy()[len(prompt) - 1:end]


def check_ranks_against_hf(out_dir, world_size, hf, launcher, results="npz"):
    """`results`: the worker's file suffix (npz: its first model; model2.npz: its second)."""
    missing = [r for r in range(world_size) if not os.path.exists(
        os.path.join(out_dir, f"rank_{r}.{results}"))]
    assert not missing, f"ranks {missing} wrote no results"
    ranks = [dict(np.load(os.path.join(out_dir, f"rank_{r}.{results}")))
             for r in range(world_size)]
    for r, rank in enumerate(ranks):
        assert int(rank["world_size"]) == world_size
        assert str(rank["launcher"]) == launcher
        np.testing.assert_array_equal(rank["tokens"], ranks[0]["tokens"], f"rank {r} tokens")
        np.testing.assert_array_equal(rank["logprobs"], ranks[0]["logprobs"],
                                      f"rank {r} logprobs")
    tokens, logprobs = ranks[0]["tokens"], ranks[0]["logprobs"]  # (rows, 9 steps, vocab)
    for row, prompt in enumerate(PROMPTS):
        expected = hf_reference(hf, prompt, tokens[row].tolist())
        assert tokens[row].tolist() == expected.argmax(-1).tolist(), f"prompt {row} tokens"
        diff = np.abs(logprobs[row] - expected[:logprobs.shape[1]]).max()
        assert diff < 1e-4, f"prompt {row}: log-probs differ from transformers by {diff}"
    return ranks


def run_losing_a_rank(cmd, out_dir, env, log_dir=None):
    """A worker job whose ranks lose one of theirs once their results are written (`env`: the
    worker's test hook); the job's exit code, output (with msrun's logs) and the seconds from
    the rank's death or failure to the end of the job."""
    code, out, _ = run_job(cmd, env=env)
    ended = time.time()
    if log_dir is not None:
        out += "".join(p.read_text() for p in sorted(log_dir.glob("*.log")))
    down_at = out_dir / "down_at"
    lost = float(down_at.read_text()) if down_at.exists() else None
    return SimpleNamespace(code=code, out=out, dir=out_dir,
                           down_seconds=None if lost is None else ended - lost)


@pytest.fixture(scope="module")
def four_ranks(models, tmp_path_factory):
    """One start of 4 ranks under mpirun (a start costs what two models' runs do on 2 cores):
    the tied Qwen2 under dp2 x tp2 with SAMPLING (every output's fields, rank_R.json); the GQA
    Qwen2 (model2) and the tied Qwen3 (model3, 9 new tokens: fewer decode batches to compile)
    under tp4; the yarn Qwen2 under dp2 x tp2 (model4, 9 new tokens), all with graphs of dynamic
    shape, the default (the tp2 job runs the static ones); after the results, rank 2 is
    SIGKILLed. Returns the job and the transformers tokens SAMPLING was made from."""
    out_dir = tmp_path_factory.mktemp("four_ranks")
    hf = models["tied"][1]
    hf_tokens = [hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
                 for prompt in PROMPTS]
    sampling, stop = sampling_cases(models["tied"][0], hf_tokens)
    dp2_tp2, tp4 = (os.path.join(STRATEGIES, name)
                    for name in ("qwen2_dp2_tp2.yaml", "qwen2_tp4.yaml"))
    cmd = (mpirun_prefix(4) + [sys.executable]
           + worker_args(models["tied"][0], "qwen2_dp2_tp2.yaml", out_dir)
           + ["--sampling", json.dumps(sampling)]
           + ["--model2", models["gqa"][0], "--model2-strategy", tp4,
              "--model2-new-tokens", str(NEW_TOKENS)]
           + ["--model2", models["qwen3_tied"][0], "--model2-strategy", tp4,
              "--model2-new-tokens", "9"]
           + ["--model2", models["yarn"][0], "--model2-strategy", dp2_tp2,
              "--model2-new-tokens", "9"])
    job = run_losing_a_rank(cmd, out_dir, {"MSINFER_TEST_KILL_RANK": "2"})
    return SimpleNamespace(job=job, sampling=sampling, stop=stop, hf_tokens=hf_tokens)


def sampling_cases(model_dir, hf_tokens):
    """Replica 0 runs prompts 0 and 2, replica 1 prompts 1 and 3. Replica 1's are the telling
    ones: prompt 1 is cut at a stop string (with logprobs), prompt 3 reports 5 logprobs per
    token and ends at max_tokens; replica 0's prompt 0 stops at a stop token id."""
    from msinfer.engine.tokenizer import Tokenizer

    # Two characters from the middle of what prompt 1 generates: its text is cut there.
    text = Tokenizer.from_model_dir(model_dir).decode(hf_tokens[1])
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if "\ufffd" not in text[i:i + 2])
    greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [dict(greedy, stop_token_ids=[hf_tokens[0][9]]), dict(greedy, stop=[stop], logprobs=2),
            dict(greedy), dict(greedy, logprobs=5)], stop


@pytest.fixture(scope="module")
def tp2_msrun(models, tmp_path_factory):
    """tp2 under msrun on the tied checkpoint, with every MLP and lm_head product weight first
    (the vocabulary-split lm_head gathers its transposed blocks), then on the untied Qwen3 in
    the same job (9 new tokens), with graphs of static shape (one per call shape); after the
    results, rank 1 fails with a user error."""
    out_dir = tmp_path_factory.mktemp("tp2_msrun")
    cmd = (msrun_prefix(2, out_dir / "logs")
           + worker_args(models["tied"][0], "qwen2_tp2.yaml", out_dir) + ["--weight-first"]
           + ["--model2", models["qwen3_untied"][0], "--model2-new-tokens", "9",
              "--graph-shapes", "static"])
    # msrun ends once MindSpore's scheduler does, which declares the worker msrun killed lost
    # after MS_NODE_TIMEOUT seconds without a heartbeat: 30 by default, 10 here.
    env = {"MSINFER_TEST_FAIL_RANK": "1", "MS_NODE_TIMEOUT": "10"}
    return run_losing_a_rank(cmd, out_dir, env, log_dir=out_dir / "logs")


def test_tp4_under_mpirun_matches_hf_with_replicated_kv_heads(models, four_ranks):
    model_dir, hf = models["gqa"]
    job = four_ranks.job
    assert job.down_seconds is not None, job.out[-3000:]  # every rank got past its results
    assert "each KV head on 2 ranks" in job.out
    ranks = check_ranks_against_hf(job.dir, 4, hf, "mpirun-bridge", results="model2.npz")
    assert ranks[0]["tokens"].shape == (len(PROMPTS), NEW_TOKENS)
    # Each rank holds its slice only: the sharded tensors a quarter, the norms whole, the
    # 2 KV heads once per pair of ranks.
    full_bytes = sum(p.numel() for p in hf.parameters()) * 4
    assert all(int(r["param_bytes"]) < 0.35 * full_bytes for r in ranks)
    # Planner = engine: each rank holds exactly the bytes the plan reports for it.
    from msinfer.config import ModelConfig
    from msinfer.hardware import get_profile
    from msinfer.parallel.strategy import load_strategy
    from msinfer.engine_config import EngineLimits
    from msinfer.planning.planner import make_plan

    config = ModelConfig.from_model_dir(model_dir)
    limits = EngineLimits.for_model(config, max_len=128, block_size=4, max_prefill_tokens=16,
                                    kv_cache_memory=1 << 20)
    report = make_plan(config, load_strategy(os.path.join(STRATEGIES, "qwen2_tp4.yaml")),
                       get_profile("cpu"), limits)
    assert [int(r["param_bytes"]) for r in ranks] == [d.weights_bytes for d in report.devices]
    assert [int(r["kv_bytes"]) for r in ranks] == [d.kv_cache_bytes for d in report.devices]


def test_tp4_under_mpirun_runs_qwen3_as_transformers_does(models, four_ranks):
    """Qwen3 at tp4: one KV head and two query heads per rank, the q/k norms whole on every
    rank, the tied embedding split by vocabulary (lm_head gathered); the same job, after the
    Qwen2 checkpoints."""
    model_dir, hf = models["qwen3_tied"]
    job = four_ranks.job
    assert job.down_seconds is not None, job.out[-3000:]
    ranks = check_ranks_against_hf(job.dir, 4, hf, "mpirun-bridge", results="model3.npz")
    assert ranks[0]["tokens"].shape == (len(PROMPTS), 9)
    full_bytes = sum(p.numel() for p in hf.parameters()) * 4
    assert all(int(r["param_bytes"]) < 0.4 * full_bytes for r in ranks)


def test_dp2_tp2_runs_qwen2_with_yarn_as_transformers_does(models, four_ranks):
    """Qwen2 with yarn rope scaling under dp2 x tp2 (one KV head per rank), positions up to 48
    past its original 32, the same on every rank; the same job, fourth."""
    job = four_ranks.job
    assert job.down_seconds is not None, job.out[-3000:]
    ranks = check_ranks_against_hf(job.dir, 4, models["yarn"][1], "mpirun-bridge",
                                   results="model4.npz")
    assert ranks[0]["tokens"].shape == (len(PROMPTS), 9) and max(map(len, PROMPTS)) + 9 > 32


@pytest.mark.multirank(ranks=2)  # beside the 4-rank jobs (conftest.py)
def test_tp2_under_msrun_matches_hf_with_tied_embeddings(models, tp2_msrun):
    """Also with every MLP and lm_head product weight first: the vocabulary-split lm_head
    gathers its transposed blocks."""
    job = tp2_msrun
    assert job.down_seconds is not None, job.out[-3000:]  # every rank got past its results
    check_ranks_against_hf(job.dir, 2, models["tied"][1], "msrun")


@pytest.mark.multirank(ranks=2)  # beside the 4-rank jobs (conftest.py)
def test_tp2_under_msrun_runs_qwen3_as_transformers_does(models, tp2_msrun):
    """Untied Qwen3 at tp2 (two query heads of 32 and one KV head per rank, q/k norms whole),
    after the tied Qwen2 in the same job."""
    job = tp2_msrun
    assert job.down_seconds is not None, job.out[-3000:]
    ranks = check_ranks_against_hf(job.dir, 2, models["qwen3_untied"][1], "msrun",
                                   results="model2.npz")
    assert ranks[0]["tokens"].shape == (len(PROMPTS), 9)


def test_dp2_tp2_every_rank_returns_exactly_what_one_process_returns(models, four_ranks):
    """Two data replicas of two tensor ranks under mpirun (the job's first model), each in its
    own tensor group: every rank returns every output with every field as its replica computed
    it (sampling_cases: stop strings, stop token ids, logprobs, max_tokens)."""
    from distributed_worker import output_fields

    from msinfer import LLM, SamplingParams

    model_dir = models["tied"][0]
    job, sampling, stop, hf_tokens = (four_ranks.job, four_ranks.sampling, four_ranks.stop,
                                      four_ranks.hf_tokens)
    assert job.down_seconds is not None, job.out[-3000:]
    assert "2 data replicas" in job.out
    ranks = [json.loads((job.dir / f"rank_{r}.json").read_text()) for r in range(4)]
    for r, outputs in enumerate(ranks):  # exactly, floats included: nothing lost on the way
        assert outputs == ranks[0], f"rank {r} differs from rank 0"
    results = ranks[0]
    # What the engine in one process returns for the same prompts and sampling, field by field.
    llm = LLM(model_dir, max_len=128, block_size=4, max_prefill_tokens=16,
              kv_cache_memory=1 << 20)
    expected = [json.loads(json.dumps(output_fields(out)))
                for out in llm.generate(PROMPTS, [SamplingParams(**s) for s in sampling])]
    for i, (result, one) in enumerate(zip(results, expected)):
        got_logprobs, one_logprobs = result["logprobs"], one["logprobs"]
        assert dict(result, logprobs=None) == dict(one, logprobs=None), f"prompt {i}"  # all else
        if one_logprobs is None:
            assert got_logprobs is None, f"prompt {i}"
            continue
        # Tensor-parallel sums add in another order than one process's: same ids, close values.
        assert [[t for t, _ in step] for step in got_logprobs] == [
            [t for t, _ in step] for step in one_logprobs], f"prompt {i} logprob ids"
        np.testing.assert_allclose([lp for step in got_logprobs for _, lp in step],
                                   [lp for step in one_logprobs for _, lp in step], atol=1e-5)
    # and the tokens are transformers' greedy ones, up to where a stop ended them
    for i, result in enumerate(results):
        assert result["request_id"] == f"generate-1-{i}"
        assert result["token_ids"] == hf_tokens[i][:len(result["token_ids"])], f"prompt {i}"
    # The cases asked for happened.
    assert [r["finish_reason"] for r in results] == ["stop", "stop", "length", "length"]
    assert len(results[0]["token_ids"]) <= 10 and results[0]["token_ids"][-1] == hf_tokens[0][9]
    assert stop not in results[1]["text"] and len(results[1]["token_ids"]) < NEW_TOKENS
    assert len(results[1]["logprobs"]) == len(results[1]["token_ids"])
    assert {len(step) for step in results[3]["logprobs"]} == {5}  # the greedy token among them
    assert len(results[3]["token_ids"]) == NEW_TOKENS


def test_outputs_cross_the_replica_exchange_with_every_field_intact():
    """What the job above cannot produce on demand: "error" and "abort" outputs, an error
    message, non-ASCII text, an infinite logprob (the exchange's encoding, alone: no
    collective runs at world size 1, the JSON round trip does)."""
    from msinfer.api import _output_from_json, _output_to_json
    from msinfer.engine import RequestOutput
    from msinfer.parallel.distributed import DistInfo, all_gather_json

    outputs = [
        RequestOutput(request_id="generate-3-1", prompt="héllo ✓", prompt_token_ids=[1, 2],
                      token_ids=[5, 6], text="ab\u00e9", finished=True, finish_reason="error",
                      logprobs=[{5: -0.1, 7: -2.5000000000000004}, {6: float("-inf")}],
                      error="non-finite logits (NaN or inf) for request 'generate-3-1' ..."),
        RequestOutput(request_id="generate-3-3", prompt=None, prompt_token_ids=[3],
                      token_ids=[], text="", finished=True, finish_reason="abort")]
    alone = DistInfo(rank=0, world_size=1, launcher="single")
    (back,) = all_gather_json(alone, [_output_to_json(out) for out in outputs])
    assert [_output_from_json(fields) for fields in back] == outputs


def test_a_killed_rank_brings_the_mpirun_job_down_quickly(four_ranks):
    """Rank 2 SIGKILLs itself while ranks 0, 1 and 3 wait for it in a collective."""
    job = four_ranks.job
    assert job.down_seconds is not None, job.out[-3000:]
    assert job.code != 0
    assert job.down_seconds < DOWN_WITHIN, f"job down {job.down_seconds:.0f}s after the kill"
    assert not list(job.dir.glob("*.survived"))  # nobody went on as if nothing happened


@pytest.mark.multirank(ranks=2)  # beside the 4-rank jobs (conftest.py)
def test_a_failing_rank_brings_the_msrun_job_down_with_its_message(tp2_msrun):
    """Rank 1 exits with a user error (code 2) while rank 0 waits for it in a collective."""
    job = tp2_msrun
    assert job.down_seconds is not None, job.out[-3000:]
    assert job.code != 0
    assert "error: rank 1: injected failure (test hook)" in job.out
    assert job.down_seconds < DOWN_WITHIN, f"job down {job.down_seconds:.0f}s after the failure"
    assert not list(job.dir.glob("*.survived"))
