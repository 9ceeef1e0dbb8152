"""The planner on msModelSlim's quantized models: int8 weights and their per-row scales
counted, against figures worked out here by hand from the published Qwen2.5-72B config;
Qwen2.5-72B in W8A8 on one Atlas 300I Duo card (two chips, tp2) with its KV budget and the
decode bound of its smaller weight bytes, where the float model does not fit."""
import os

from msinfer.cli.main import main
from msinfer.config import PRESETS, load_config
from msinfer.hardware import get_profile
from msinfer.parallel.strategy import load_strategy
from msinfer.engine_config import EngineLimits
from msinfer.planning.planner import make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DUO = get_profile("atlas-300i-duo")
TP2 = load_strategy(os.path.join(ROOT, "strategies", "qwen2_tp2.yaml"))


def plan(model, max_len=8192, mode=None):
    config = load_config(model)
    return make_plan(config, TP2, DUO, EngineLimits.for_model(config, max_len=max_len),
                     parallel_mode=mode)


def test_qwen25_72b_w8a8_fits_one_300i_duo_card_where_float_does_not():
    assert not plan("qwen2.5-72b").fits
    report = plan("qwen2.5-72b-w8a8")
    assert report.fits, report.errors
    # By hand, per chip of tp2 (hidden 8192, 8 KV heads of 128, intermediate 29568, 80
    # layers, vocabulary 152064, float16 on 310P):
    hidden, kv, inter, vocab, layers = 8192, 1024, 29568, 152064, 80
    int8 = layers * hidden * (hidden + 2 * kv + hidden + 3 * inter) // 2  # 1 byte each
    # deq_scale (float32) + quant_bias (int32) per output row this chip holds: half the
    # rows of q/k/v and gate/up, all rows of the row-split o and down
    scales = layers * 8 * ((hidden + 2 * kv) // 2 + inter + hidden + hidden)
    floats = 2 * (2 * vocab * hidden // 2            # embedding and lm_head, vocab-split
                  + layers * 2 * hidden + hidden     # norms
                  + layers * (hidden + 2 * kv) // 2)  # q/k/v biases (unused, loaded)
    # input_scale and input_offset (float16) of q/k/v, o, gate/up and down, whole on each chip
    activation = layers * 4 * 2 * 2
    assert report.devices[0].weights_bytes == int8 + scales + floats + activation
    assert report.devices[0].weights_bytes < 0.55 * plan("qwen2.5-72b").devices[0].weights_bytes
    assert report.kv_tokens >= 8192 and report.max_concurrency >= 1
    # The decode bound reads the int8 bytes: weights less the embedding table per step.
    read = report.devices[0].weights_bytes - vocab * hidden // 2 * 2
    assert abs(report.decode_tokens_per_s_bound_short_context
               - 16 * DUO.memory_bandwidth_bytes_per_s / read) < 1e-6
    assert "W8A8" in report.quantization


def test_quantized_presets_and_what_the_plan_says(capsys):
    for name, scheme in {"qwen2.5-72b-w8a8": "W8A8", "qwen2.5-32b-w8a8": "W8A8",
                         "qwen3-32b-w8a8": "W8A8", "qwen2.5-7b-w8a16": "W8A16"}.items():
        quantization = PRESETS[name].quantization
        schemes = {s for signature in quantization.layer_schemes for s in signature}
        assert len(quantization.layer_schemes) == PRESETS[name].num_layers
        assert schemes == {scheme}, name
    w8a16, float16 = plan("qwen2.5-7b-w8a16"), plan("qwen2.5-7b")
    assert 0.5 < w8a16.devices[0].weights_bytes / float16.devices[0].weights_bytes < 0.65
    code = main(["plan", "--model", "qwen2.5-72b-w8a8", "--strategy",
                 os.path.join(ROOT, "strategies", "qwen2_tp2.yaml"), "--hardware",
                 "atlas-300i-duo", "--max-len", "8192"])
    out = capsys.readouterr().out
    assert code == 0 and "quantized  W8A8" in out and "FITS" in out, out


def test_semi_auto_plans_a_quantized_model_for_ascend_only():
    """Its layout is what `msinfer layouts` checks (tests/tools/test_layouts.py); its Ascend
    primitives have no CPU kernel, and W8A8_DYNAMIC has no Ascend method."""
    import dataclasses

    from msinfer.quantization import preset

    assert plan("qwen2.5-72b-w8a8", mode="semi_auto").fits
    config = load_config("qwen2.5-7b-w8a16")
    tp1 = load_strategy(os.path.join(ROOT, "strategies", "qwen2_tp1.yaml"))
    on_cpu = make_plan(config, tp1, get_profile("cpu"), EngineLimits.for_model(config),
                       parallel_mode="semi_auto")
    assert "qwen2.5-7b-w8a16: a quantized checkpoint (W8A16) under semi_auto" in \
        on_cpu.errors[0] and "no CPU kernel" in on_cpu.errors[0]
    assert "`msinfer layouts` checks its semi_auto layout" in on_cpu.errors[0]
    dynamic = dataclasses.replace(config, quantization=preset("W8A8_DYNAMIC",
                                                              config.num_layers))
    report = make_plan(dynamic, TP2, DUO, EngineLimits.for_model(dynamic),
                       parallel_mode="semi_auto")
    assert "W8A8_DYNAMIC runs in parallel_mode explicit only" in report.errors[0]


def test_layers_left_float_are_counted_in_their_own_scheme_and_graphs():
    """Qwen2.5-72B W8A8 with two layers' down_proj left float (msModelSlim's disable_names):
    each of those weighs its float16 bytes instead of int8 and scales, the plan names them,
    and warm-up compiles more graphs (a stack covering a float layer is a kind of its own)."""
    import dataclasses

    uniform = PRESETS["qwen2.5-72b-w8a8"]
    schemes = list(uniform.quantization.layer_schemes)
    for layer in (0, 79):
        schemes[layer] = schemes[layer][:3] + ("FLOAT",)
    left = dataclasses.replace(uniform, quantization=dataclasses.replace(
        uniform.quantization, layer_schemes=tuple(schemes)))
    limits = EngineLimits.for_model(uniform, max_len=8192)
    before, after = (make_plan(c, TP2, DUO, limits) for c in (uniform, left))
    # down_proj (8192 x 29568) is split by input at tp2: 8192 rows of 14784 per chip, float16
    # where it was int8 with a float32 deq_scale and an int32 quant_bias per row, and its
    # float16 input_scale and input_offset
    rows, cols = 8192, 29568 // 2
    assert after.devices[0].weights_bytes - before.devices[0].weights_bytes == \
        2 * (rows * cols * 2 - (rows * cols + rows * 8 + 2 * 2))
    assert "down W8A8, FLOAT in layers 0, 79" in after.quantization
    assert after.warmup_graphs > before.warmup_graphs
