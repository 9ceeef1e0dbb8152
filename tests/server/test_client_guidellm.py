"""guidellm 0.8.1 (the vLLM project's serving benchmark) runs unmodified against the session's
real server (conftest's tiny_server): a synchronous run on /v1/chat/completions and a
constant-rate run on /v1/completions, offline (synthetic prompts from the checkpoint's own
tokenizer), each bounded by a request count. guidellm streams with `stream_options.
continuous_usage_stats`, `stop: null` and `ignore_eos`, and probes GET /health first (issue 21).

guidellm needs numpy>=2, which MindSpore 2.10 cannot import with, so it runs from its own venv:
.venv-guidellm (setup.cfg has the commands) or the executable $MSINFER_GUIDELLM names.
"""
import json
import os
import subprocess

import pytest

from servers import MAX_LEN, NAME, ROOT

GUIDELLM = os.environ.get("MSINFER_GUIDELLM") or os.path.join(ROOT, ".venv-guidellm", "bin",
                                                              "guidellm")
# A developer without it is told; CI (launch/quickstart.sh installs it) runs it, and fails
# on its absence.
pytestmark = pytest.mark.skipif(
    not os.access(GUIDELLM, os.X_OK) and not os.environ.get("CI"),
    reason=f"guidellm not installed at {GUIDELLM} (launch/quickstart.sh makes .venv-guidellm)")

PROMPT_TOKENS, OUTPUT_TOKENS = 24, 8  # within the tiny server's MAX_LEN
assert PROMPT_TOKENS + OUTPUT_TOKENS < MAX_LEN


RUNS = {  # request format: guidellm profile
    "/v1/chat/completions": "kind=synchronous",
    "/v1/completions": "kind=constant,rate=4",
}
COUNT = 4  # requests per run


def start_guidellm(server, checkpoint, out_path, request_format, profile):
    """A `guidellm run` against `server`, started; (process, report path)."""
    command = [
        GUIDELLM, "run",
        "--backend", f"kind=openai_http,target={server.url},model={NAME},"
                     f"request_format={request_format},timeout=60",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={COUNT}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                  f"output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={checkpoint}",
        "--output", f"kind=json,path={out_path}",
        "--disable-console-interactive",
    ]
    # offline: the tokenizer is the checkpoint directory; nothing may be fetched
    # one worker process, not guidellm's default 10 (each spawned one imports torch and
    # transformers again: most of a run's time on 2 cores, for 4 requests)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH="", GUIDELLM__MAX_WORKER_PROCESSES="1")
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finished(server):
    """Requests the server has finished (0 before its first: the counter has no sample yet)."""
    try:
        return server.metric("vllm:request_success_total")
    except AssertionError:
        return 0


def test_guidellm_synchronous_and_constant_rate(tiny_server, serve_model, tmp_path):
    """Both runs at once (guidellm's start-up, not the requests, is most of each run's time):
    every request succeeds, the server counts each one finished, and each produced the
    tokens guidellm asked for (by the server's usage), from a prompt of the length guidellm's
    own tokenizer made it (completions: no chat template around it)."""
    before = finished(tiny_server)
    runs = {fmt: (start_guidellm(tiny_server, serve_model, tmp_path / f"{i}.json", fmt, profile),
                  tmp_path / f"{i}.json") for i, (fmt, profile) in enumerate(RUNS.items())}
    for fmt, (process, _) in runs.items():
        try:
            output, _ = process.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            pytest.fail(f"guidellm {fmt} did not finish in 150 s:\n{output[-3000:]}")
        assert process.returncode == 0, f"guidellm {fmt}:\n{output[-3000:]}"
    for fmt, (_, path) in runs.items():
        with open(path) as f:
            (benchmark,) = json.load(f)["benchmarks"]
        totals = benchmark["metrics"]["request_totals"]
        state = benchmark["scheduler_state"]
        assert state["created_requests"] == COUNT, (fmt, state["created_requests"])
        assert (totals["errored"], totals["incomplete"]) == (0, 0), (fmt, totals)
        # guidellm can close a benchmark with its last response still on the way to its
        # aggregator (seen under load: 3 of 4 recorded, scheduler_state.processing_requests 1);
        # the server's count below shows that one finished too
        assert totals["successful"] + state["processing_requests"] == COUNT, (fmt, totals)
        assert totals["successful"] >= COUNT - 1, (fmt, totals)
        requests = benchmark["requests"]["successful"]
        assert all(r["output_tokens"] == OUTPUT_TOKENS for r in requests), fmt
        if fmt == "/v1/completions":
            assert all(r["prompt_tokens"] == PROMPT_TOKENS for r in requests)
        else:  # the chat template adds its own tokens around the prompt
            assert all(r["prompt_tokens"] > PROMPT_TOKENS for r in requests)
    assert finished(tiny_server) - before == COUNT * len(RUNS)
