"""Non-finite logits are an error, not a token. A tiny checkpoint is planted to overflow
float16 on token 0 (its embedding points along one hidden dimension, on which one unit of
layer 0's MLP has weights of 45: silu(gate) x up reaches ~1e5 > 65504), so in float16 on CPU
any sequence holding token 0 computes inf, then NaN; in float32 nothing overflows.

Token 0 is also what padded positions of a compiled call hold: every padded token writes
NaN K/V into the reserved block's write slot, which real rows must never read (they read its
zero slot), and one prompt's NaN K/V must not reach the other prompts of its prefill chunk
(layers/attention.py _finite_context)."""
import json
import logging
import os
import re

import httpx2 as httpx
import numpy as np
import pytest

from msinfer.cli.main import main
from msinfer.engine.sampling import SamplingParams
from msinfer.tools.tiny_model import make_tiny_model

pytest.importorskip("mindspore")

from msinfer import LLM, log  # noqa: E402
from msinfer import NonFiniteLogits  # noqa: E402
from test_serve_protocol import MODEL, RunningServer  # noqa: E402

POISON = 0
ENGINE = dict(max_len=64, max_num_seqs=4, max_prefill_tokens=32, block_size=4)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CLEAN = [[5, 6, 7, 8], [13, 14, 15, 16, 17, 18], [21, 22, 23]]
POISONED = [9, 10, POISON, 11, 12]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    path = str(tmp_path_factory.mktemp("nonfinite") / "model")
    make_tiny_model(path, layers=2, hidden=64, heads=4, kv_heads=2, vocab=512,
                    max_position=256)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    weights["model.embed_tokens.weight"][POISON] = 0.0
    weights["model.embed_tokens.weight"][POISON, 0] = 20.0
    weights["model.layers.0.post_attention_layernorm.weight"][0] = 1.0
    weights["model.layers.0.mlp.gate_proj.weight"][0, 0] = 45.0
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = 45.0
    save_file(weights, file)
    return path


@pytest.fixture(scope="module")
def fp16(planted):
    return LLM(planted, dtype="float16", **ENGINE)


@pytest.fixture(scope="module")
def alone(fp16):
    """Each clean prompt's float16 tokens, run by itself."""
    return [fp16.generate([p], GREEDY)[0].token_ids for p in CLEAN]


def test_the_plant_overflows_only_in_float16(planted, fp16):
    fp32 = LLM(planted, dtype="float32", **ENGINE)
    out, = fp32.generate([POISONED], GREEDY)  # alone: one decode batch size to compile
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens
    with pytest.raises(NonFiniteLogits):
        fp16.generate([POISONED], GREEDY)


def test_offline_generate_raises_naming_float16_overflow_and_what_to_do(fp16, alone):
    with pytest.raises(NonFiniteLogits) as e:
        fp16.generate([CLEAN[0], POISONED, CLEAN[1], CLEAN[2]], GREEDY)
    message = str(e.value)
    assert message.startswith("non-finite logits (NaN or inf) for request 'generate-")
    for needle in ("overflowed float16", "65504", "float32", "bfloat16", "atlas-800i-a2",
                   "docs/engine.md"):
        assert needle in message
    assert e.value.exit_code == 1
    # every prompt finished; the one that overflowed with "error", the others as alone
    outs = e.value.outputs
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert outs[1].token_ids == [] and outs[1].error == message
    assert [outs[i].token_ids for i in (0, 2, 3)] == alone


def test_padding_writes_nan_that_no_real_row_reads(fp16, alone):
    runner = fp16.engine.runner
    kv = fp16.memory.layout.kv_heads
    outs = fp16.generate(CLEAN, GREEDY)  # 3 prompts: padded chunks, a padded decode batch
    assert [o.token_ids for o in outs] == alone
    # the padded tokens (id 0) did overflow: layer 1's K in the write slot is not finite
    k1 = runner.caches[1][0].asnumpy()
    assert not np.isfinite(k1[runner.write_slot * kv:(runner.write_slot + 1) * kv]).all()
    assert (k1[runner.zero_slot * kv:(runner.zero_slot + 1) * kv] == 0).all()
    # reading the write slot for padded positions (as before the zero slot) poisons them all
    zero_slot = runner.zero_slot
    runner.zero_slot = runner.write_slot
    try:
        with pytest.raises(NonFiniteLogits) as e:
            fp16.generate(CLEAN, GREEDY)
        assert all(o.finish_reason == "error" for o in e.value.outputs)
    finally:
        runner.zero_slot = zero_slot
    assert [o.token_ids for o in fp16.generate(CLEAN, GREEDY)] == alone


def test_the_engine_fails_the_request_and_the_others_go_on(fp16, alone):
    engine = fp16.engine
    engine.add_request("a", CLEAN[0], GREEDY)
    outputs = {}
    for out in engine.step():
        outputs[out.request_id] = out
    engine.add_request("bad", POISONED, GREEDY)  # joins while "a" decodes
    engine.add_request("c", CLEAN[1], GREEDY)  # shares the prefill chunk with "bad"
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    bad = outputs["bad"]
    assert bad.finished and bad.finish_reason == "error" and bad.token_ids == []
    assert "overflowed float16" in bad.error
    assert outputs["a"].token_ids == alone[0] and outputs["c"].token_ids == alone[1]
    assert engine.stats().num_blocks_used == 0  # the failed request's blocks are freed


def test_doctor_recognises_the_logged_error(fp16, tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    handler = logging.FileHandler(logs / "rank0.log")
    log.get().addHandler(handler)
    try:
        with pytest.raises(NonFiniteLogits):
            fp16.generate([POISONED], GREEDY)
    finally:
        log.get().removeHandler(handler)
        handler.close()
    assert main(["doctor", "--hardware", "cpu", "--logs", str(logs), "--json"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    found = checks["logs.non-finite-logits"]
    assert found["status"] == "fail" and "rank0.log:1" in found["detail"]
    assert "float16" in found["detail"] and "bfloat16" in found["detail"]


@pytest.fixture(scope="module")
def server(fp16):
    s = RunningServer(llm=fp16)
    yield s
    s.stop()


def test_http_answers_an_openai_error_and_serves_the_others(server, alone):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        bad = c.post("/v1/completions", json={"model": MODEL, "prompt": POISONED,
                                              "max_tokens": 6, "temperature": 0})
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": CLEAN[0],
                                             "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True})
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert error["type"] == "internal_error" and error["code"] == "non_finite_logits"
    assert "overflowed float16" in error["message"] and "Traceback" not in bad.text
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["finish_reason"] == "length"
    metrics = httpx.get(server.url + "/metrics").text
    # every finish reason has its sample from the start (as vLLM's): this one counted
    errors = re.search(r'vllm:request_success_total\{engine="0",finished_reason="error",'
                       r'model_name="fake-model"\} (\S+)', metrics)
    assert float(errors.group(1)) >= 1


def test_a_stream_gets_finish_reason_error_an_error_event_then_done(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": POISONED, "max_tokens": 6, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "non_finite_logits" and "float16" in error["message"]
    last_chunk = json.loads(lines[-3][len("data: "):])
    assert last_chunk["choices"][0]["finish_reason"] == "error"
