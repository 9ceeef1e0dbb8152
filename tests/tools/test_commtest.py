"""`msinfer commtest`: the nccl-tests arithmetic, the chip pairs of a 300I Duo, and real jobs
under mpirun on CPU (a healthy 4-rank start checking table, JSON and checks together; a 2-rank
one with a rank that contributes a wrong value, which must fail with exit code 1)."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from msinfer.cli.main import main
from msinfer.errors import MsinferError
from msinfer.hardware import get_profile
from msinfer.parallel.strategy import Strategy
from msinfer.tools.commtest import (bandwidths, contribution, elements, expected, format_report,
                                    message_sizes, model_estimate, pair_groups, parse_size)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DP2_TP2 = os.path.join(ROOT, "strategies", "qwen2_dp2_tp2.yaml")
TP4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")
TP2 = os.path.join(ROOT, "strategies", "qwen2_tp2.yaml")
JOB_TIMEOUT = 240
SMALL = ["--max-bytes", "2K", "--factor", "16", "--iters", "3", "--warmup", "1"]
# MindSpore's workers retry joining the scheduler every 3-5 s by default: rank 0 starts the
# scheduler once it has imported MindSpore, so each job waited for one retry (~5 s a job).
FAST_JOIN = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}


def test_sizes_follow_hccl_test_notation():
    assert parse_size("8") == 8 and parse_size("64K") == 65536
    assert parse_size("64M") == 64 * 2 ** 20
    assert message_sizes(8, 64, 2) == [8, 16, 32, 64]
    assert message_sizes(8, 100, 4) == [8, 32]
    for bad in ("0", "-1", "8X", ""):
        with pytest.raises(MsinferError, match="size"):
            parse_size(bad)
    with pytest.raises(MsinferError, match="--factor"):
        message_sizes(8, 64, 1)


def test_allgather_size_is_the_gathered_output_as_in_nccl_tests():
    assert elements("AllReduce", 1024, 4, 4) == (256, 1024)
    assert elements("AllGather", 1024, 4, 4) == (64, 1024)  # each rank sends a quarter
    assert elements("AllGather", 8, 4, 4) == (1, 16)  # at least one element per rank


def test_bus_bandwidth_uses_the_nccl_tests_factors():
    algbw, busbw = bandwidths("AllReduce", 1e9, 1.0, 4)
    assert (algbw, busbw) == (1.0, 1.5)  # 2(n-1)/n
    algbw, busbw = bandwidths("AllGather", 1e9, 0.5, 8)
    assert algbw == 2.0 and busbw == pytest.approx(1.75)  # (n-1)/n


def test_expected_values_are_exact_in_float16():
    ranks = list(range(8))
    total = expected("AllReduce", ranks, 4096, np.float16)
    exact = sum(contribution(r, 4096, np.float64) for r in ranks)
    assert np.array_equal(total.astype(np.float64), exact)
    gathered = expected("AllGather", [2, 3], 3, np.float32)
    assert gathered.tolist() == [3, 4, 5, 4, 5, 6]
    assert contribution(1, 3, np.float32, corrupt=True).tolist() == [3, 3, 4]


def test_chips_2k_and_2k1_share_a_card():
    groups = pair_groups(list(range(8)))
    assert groups["same-card pairs"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cross-card pairs"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # ranks on chips 4-7 (a rank table may start anywhere): pairs follow the chips
    groups = pair_groups([5, 4, 7, 6])
    assert groups["same-card pairs"] == [[1, 0], [3, 2]]
    assert groups["cross-card pairs"] == [[1, 3], [0, 2]]
    # one card: no cross-card pair; a lone chip pairs with nobody
    assert pair_groups([0, 1])["cross-card pairs"] == []
    assert pair_groups([0, 1, 2])["same-card pairs"] == [[0, 1]]


def test_the_model_estimate_times_each_collective_at_the_next_measured_size():
    rows = [{"group": "world", "op": op, "size_bytes": size, "time_us": float(size) / 100}
            for op in ("AllReduce", "AllGather") for size in (1024, 4096, 65536)]
    estimate = model_estimate("qwen2-0.5b", Strategy.default(tensor=2), get_profile("cpu"),
                              "float32", rows)
    reduce, gather = estimate["collectives"]
    # 24 layers x (o_proj + down_proj) + the vocab-split embedding, 896 float32 each
    assert (reduce["op"], reduce["count"], reduce["payload_bytes"]) == ("AllReduce", 49, 3584)
    assert (reduce["measured_at_bytes"], reduce["each_us"]) == (4096, 40.96)
    # the gathered logits (151936 float32) lie beyond the sweep: scaled from the largest size
    assert (gather["payload_bytes"], gather["measured_at_bytes"]) == (607744, 65536)
    assert gather["each_us"] == pytest.approx(6077.44)
    assert estimate["total_us"] == pytest.approx(49 * 40.96 + 6077.44)
    alone = model_estimate("qwen2-0.5b", Strategy.default(tensor=1), get_profile("cpu"),
                           "float32", rows)
    assert alone["collectives"] == [] and "no collective" in alone["note"]
    refused = model_estimate("qwen2-0.5b", Strategy.default(tensor=4), get_profile("cpu"),
                             "float32", rows)
    assert "14 attention heads do not split into 4" in refused["note"]


def test_launch_passes_commtest_to_every_rank_without_a_model_plan(capsys):
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--dry-run", "--",
                 "commtest", "--max-bytes", "1K"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "FITS" not in err  # commtest runs no model: nothing to plan
    command = out.splitlines()[0].split()  # then one line per rank's environment
    assert command[command.index("-m"):] == [
        "-m", "msinfer", "commtest", "--max-bytes", "1K", "--strategy", TP4,
        "--hardware", "cpu"]


def test_launch_still_checks_the_world_size_and_refuses_non_rank_commands(capsys):
    assert main(["launch", "--nproc", "2", "--strategy", TP4, "--dry-run", "--",
                 "commtest"]) == 2
    assert "--nproc 2 but" in capsys.readouterr().err
    assert main(["launch", "--nproc", "4", "--strategy", TP4, "--dry-run", "--",
                 "plan", "--model", "qwen2-7b"]) == 2
    assert "give the rank command after --, one of generate" in capsys.readouterr().err


def run_job(cmd, env=None):
    """A job in its own process group, killed whole on timeout; (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", GLOG_v="3", **FAST_JOIN, **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"job did not finish in {JOB_TIMEOUT}s: {' '.join(cmd)}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything a rank left behind
        except ProcessLookupError:
            pass
    return proc.returncode, out, err


def launch(*rank_args, strategy=DP2_TP2, nproc=4):
    return [sys.executable, "-m", "msinfer", "launch", "--nproc", str(nproc), "--strategy",
            strategy, "--timeout", str(JOB_TIMEOUT - 20), "--", "commtest", *rank_args]


@pytest.mark.multirank
def test_four_cpu_ranks_measure_world_tensor_groups_and_pairs_correctly(tmp_path):
    saved = tmp_path / "commtest.json"
    code, out, err = run_job(launch(*SMALL, "--pairs", "--model", "qwen2-0.5b",
                                    "--output", str(saved)))
    assert code == 0, (out + err)[-3000:]
    # rank 0 alone prints the table: one header, one line per measurement
    assert out.count("# msinfer commtest: 4 ranks (mpirun-bridge)") == 1
    assert "# tensor groups: (0,1) (2,3)" in out
    assert "# cross-card pairs: (0,2) (1,3)" in out
    assert "busbw (nccl-tests): AllReduce algbw*2(n-1)/n, AllGather algbw*(n-1)/n" in out
    assert "not measured: AllGather on tensor groups: MindSpore's CPU AllGather" in out

    report = json.loads(saved.read_text())
    assert report["ok"] is True and report["world_size"] == 4
    assert report["groups"] == {"world": [[0, 1, 2, 3]], "tensor groups": [[0, 1], [2, 3]],
                                "same-card pairs": [[0, 1], [2, 3]],
                                "cross-card pairs": [[0, 2], [1, 3]]}
    rows = report["results"]
    measured = {(r["group"], r["op"]) for r in rows}
    assert measured == {("world", "AllReduce"), ("world", "AllGather"),
                        ("tensor groups", "AllReduce"), ("same-card pairs", "AllReduce"),
                        ("cross-card pairs", "AllReduce")}
    world_ar = [r for r in rows if r["group"] == "world" and r["op"] == "AllReduce"]
    assert [r["size_bytes"] for r in world_ar] == [8, 128, 2048]
    for r in rows:
        assert r["check"] == "success" and r["time_us"] > 0
        n = r["ranks_per_group"]
        algbw = r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9
        factor = 2 * (n - 1) / n if r["op"] == "AllReduce" else (n - 1) / n
        assert r["algbw_gbps"] == pytest.approx(algbw, rel=1e-3, abs=1e-6)
        assert r["busbw_gbps"] == pytest.approx(algbw * factor, rel=1e-3, abs=1e-6)
    assert out.rstrip().endswith(f"all {len(rows)} checks: success")
    estimate = report["model_estimate"]
    assert [c["op"] for c in estimate["collectives"]] == ["AllReduce", "AllGather"]
    assert estimate["collectives"][0]["group"] == "tensor groups"
    assert estimate["collectives"][0]["measured_at_bytes"] == 2048  # 896 float32 = 3584 B
    assert estimate["collectives"][1]["each_us"] is None  # no sub-group AllGather on CPU
    assert "# per decoded token of qwen2-0.5b (batch 1 per replica, float32, tensor groups)" \
        in out
    assert format_report(report) == out.strip()  # the table is the JSON, formatted


@pytest.mark.multirank(ranks=2)
def test_a_rank_with_a_wrong_contribution_fails_the_checks_and_the_job(tmp_path):
    """Two ranks (the fewest that show whose contribution was wrong): rank 1 corrupts."""
    code, out, err = run_job(launch("--max-bytes", "64", "--factor", "8", "--iters", "2",
                                    "--warmup", "1", "--json", strategy=TP2, nproc=2),
                             env={"MSINFER_TEST_CORRUPT_RANK": "1"})
    assert code == 1, (out + err)[-3000:]
    report, _ = json.JSONDecoder().raw_decode(out[out.index("{\n"):])  # rank 0's object
    assert report["ok"] is False
    assert report["results"] and all(r["check"] == "failed" for r in report["results"])
    gathers = [r for r in report["results"] if r["op"] == "AllGather"]
    assert gathers and all(r["wrong_senders"] == [1] for r in gathers)
    assert "test hook: rank 1 contributes a wrong value" in err
