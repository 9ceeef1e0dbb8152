"""Real multi-process jobs on CPU: tensor parallelism through MindSpore's collectives.

Each test starts one job (mpirun or msrun, 2 or 4 ranks) as a subprocess and checks many
things per start: every rank agrees, log-probabilities match transformers within 1e-4, greedy
tokens are identical, each rank holds only its slice. Jobs run in their own process group and are killed
on timeout, so no rank outlives a test.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from msinfer.parallel.distributed import free_port  # noqa: E402
from msinfer.tools.tiny_model import make_tiny_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "distributed_worker.py")
STRATEGIES = os.path.join(ROOT, "strategies")
PROMPTS = [[5, 17, 42, 7, 99], [8, 9], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110],
           list(range(200, 240))]  # the last spans three 16-token prefill chunks
NEW_TOKENS = 32
JOB_TIMEOUT = 300


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny checkpoints: GQA with 2 KV heads (replicated at tp4), and a tied one."""
    made = {}
    for name, spec in {"gqa": dict(heads=8, kv_heads=2, tie=False),
                       "tied": dict(heads=4, kv_heads=4, tie=True, shards=2)}.items():
        path = str(tmp_path_factory.mktemp(name))
        make_tiny_model(path, layers=2, hidden=64, vocab=384, seed=3, **spec)
        hf = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        made[name] = (path, hf)
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
    env = dict(os.environ, PYTHONUNBUFFERED="1", GLOG_v="3", **(env or {}))
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
    return torch.log_softmax(logits, -1).numpy()[len(prompt) - 1:len(prompt) - 1 + NEW_TOKENS]


def check_ranks_against_hf(out_dir, world_size, hf, launcher):
    ranks = [dict(np.load(os.path.join(out_dir, f"rank_{r}.npz"))) for r in range(world_size)]
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


def test_tp4_under_mpirun_matches_hf_with_replicated_kv_heads(models, tmp_path):
    model_dir, hf = models["gqa"]
    code, out, _ = run_job(mpirun_prefix(4) + [sys.executable] + worker_args(model_dir, "qwen2_tp4.yaml", tmp_path))
    assert code == 0, out[-3000:]
    assert "each KV head on 2 ranks" in out
    ranks = check_ranks_against_hf(tmp_path, 4, hf, "mpirun-bridge")
    # Each rank holds its slice only: the sharded tensors a quarter, the norms whole, the
    # 2 KV heads once per pair of ranks.
    full_bytes = sum(p.numel() for p in hf.parameters()) * 4
    assert all(int(r["param_bytes"]) < 0.35 * full_bytes for r in ranks)
    # Planner = engine: each rank holds exactly the bytes the plan reports for it.
    from msinfer.config import ModelConfig
    from msinfer.hardware import get_profile
    from msinfer.parallel.strategy import load_strategy
    from msinfer.planning.memory import EngineLimits
    from msinfer.planning.planner import make_plan

    config = ModelConfig.from_model_dir(model_dir)
    limits = EngineLimits.for_model(config, max_len=128, block_size=4, max_prefill_tokens=16,
                                    kv_cache_memory=1 << 20)
    report = make_plan(config, load_strategy(os.path.join(STRATEGIES, "qwen2_tp4.yaml")),
                       get_profile("cpu"), limits)
    assert [int(r["param_bytes"]) for r in ranks] == [d.weights_bytes for d in report.devices]
    assert [int(r["kv_bytes"]) for r in ranks] == [d.kv_cache_bytes for d in report.devices]


def test_tp2_under_msrun_matches_hf_with_tied_embeddings(models, tmp_path):
    """Also with every MLP and lm_head product weight first: the vocabulary-split lm_head
    gathers its transposed blocks."""
    model_dir, hf = models["tied"]
    cmd = (msrun_prefix(2, tmp_path / "logs")
           + worker_args(model_dir, "qwen2_tp2.yaml", tmp_path) + ["--weight-first"])
    code, out, _ = run_job(cmd)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.log")))
    assert code == 0, (out + logs)[-3000:]
    check_ranks_against_hf(tmp_path, 2, hf, "msrun")


def test_msinfer_launch_dp2_tp2_prints_rank0_results_identical_to_hf_greedy(models, tmp_path):
    """Two data replicas of two tensor ranks: replica 0 runs prompts 0 and 2, replica 1
    prompt 1, each in its own tensor group; rank 0 prints all three."""
    model_dir, hf = models["tied"]
    cmd = [sys.executable, "-m", "msinfer", "launch", "--nproc", "4",
           "--strategy", os.path.join(STRATEGIES, "qwen2_dp2_tp2.yaml"), "--",
           "generate", "--model", model_dir, "--max-tokens", str(NEW_TOKENS), "--ignore-eos",
           "--max-len", "128", "--json"]
    for prompt in PROMPTS:
        cmd += ["--prompt-ids", ",".join(map(str, prompt))]
    code, out, _ = run_job(cmd)
    assert code == 0, out[-3000:]
    assert "FITS" in out  # the planner ran before the ranks started
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == len(PROMPTS)  # printed by rank 0 only
    for prompt, result in zip(PROMPTS, results):
        assert result["prompt"] == prompt
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        assert result["token_ids"] == expected[0, len(prompt):].tolist()


def test_a_killed_rank_brings_the_mpirun_job_down_quickly(models, tmp_path):
    model_dir, _ = models["gqa"]
    # "Quickly": run_job fails the test if the job is still up after 120 s.
    code, out, _ = run_job(
        mpirun_prefix(4) + [sys.executable] + worker_args(model_dir, "qwen2_tp4.yaml", tmp_path),
        env={"MSINFER_TEST_KILL_RANK": "2"}, timeout=120)
    assert code != 0
    assert not list(tmp_path.glob("rank_*.npz"))  # nobody finished as if nothing happened


def test_a_failing_rank_brings_the_msrun_job_down_with_its_message(models, tmp_path):
    model_dir, _ = models["gqa"]
    cmd = msrun_prefix(4, tmp_path / "logs") + worker_args(model_dir, "qwen2_tp4.yaml", tmp_path)
    code, out, _ = run_job(cmd, env={"MSINFER_TEST_FAIL_RANK": "1"}, timeout=200)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.log")))
    assert code != 0
    assert "rank 1: injected failure" in out + logs
    assert not list(tmp_path.glob("rank_*.npz"))
