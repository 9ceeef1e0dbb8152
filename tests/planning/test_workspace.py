"""How many decoder layers one compiled graph runs: enough for a pass in a few calls, fewer
when one layer of the engine's largest call is all the workspace allows; a divisor of the
layer count, never fewer than one."""
import pytest

from msinfer.config import load_config
from msinfer.engine_config import EngineLimits
from msinfer.parallel.strategy import Strategy
from msinfer.planning.workspace import largest_call_bytes, layer_activation_bytes, layers_per_graph


@pytest.mark.parametrize("layers,layer_bytes,budget,expected", [
    (24, 1, 100, 6),      # everything fits: a pass in 4 calls of 6 layers
    (24, 30, 100, 3),     # 3 fit, the largest divisor of 24 not above it
    (28, 1, 100, 7),
    (28, 20, 100, 4),
    (80, 1, 1000, 20),
    (4, 1, 100, 1),       # 4 layers: 4 calls of one
    (24, 100, 100, 1),
    (24, 1000, 100, 1),   # over budget still runs, one layer at a time
    (7, 10, 60, 1),       # a prime layer count: all or one
    (7, 10, 70, 7),
])
def test_layers_per_graph_is_the_largest_divisor_that_fits_in_few_calls(layers, layer_bytes,
                                                                        budget, expected):
    assert layers_per_graph(layers, layer_bytes, budget) == expected


@pytest.mark.parametrize("layers,layer_bytes,budget,expected", [
    (4, 1, 100, 2),       # the CPU floor: two calls of two, not four of one
    (24, 1, 100, 6),      # above the floor already
    (24, 40, 100, 2),
    (24, 1000, 100, 1),   # over budget: one at a time
    (3, 1, 100, 3),       # the floor's nearest divisor
    (3, 50, 100, 1),      # ... unless it does not fit
    (1, 1, 100, 1),
    (7, 10, 70, 7),
])
def test_a_floor_of_two_layers_per_graph_where_they_divide_and_fit(layers, layer_bytes, budget,
                                                                  expected):
    assert layers_per_graph(layers, layer_bytes, budget, min_layers=2) == expected


def test_largest_prefill_chunk_runs_a_layer_per_graph_and_a_short_decode_four_graphs():
    config = load_config("qwen2-1.5b")
    shard = Strategy.default().resolve(config, "explicit")
    budget = largest_call_bytes(shard, 4, EngineLimits(max_model_len=4096,
                                                       max_prefill_tokens=256, max_num_seqs=16))

    def layers(tokens, groups, context):
        layer = layer_activation_bytes(shard, 4, tokens, groups, context)
        return layers_per_graph(config.num_layers, layer, budget)

    assert layers(256, 1, 4096) == 1
    assert layers(1, 1, 64) == config.num_layers // 4
    assert layers(16, 16, 4096) < layers(16, 16, 256) <= layers(1, 1, 256)
    # The estimate grows with each of its inputs.
    base = layer_activation_bytes(shard, 4, 16, 16, 1024)
    assert base < layer_activation_bytes(shard, 4, 32, 16, 1024)
    assert base < layer_activation_bytes(shard, 4, 16, 32, 1024)
    assert base < layer_activation_bytes(shard, 4, 16, 16, 2048)


@pytest.mark.parametrize("growth,budget,expected", [
    (1.0, 200, 2),     # every layer's activations held: two layers of 100 in 200
    (0.15, 200, 6),    # 100 + 5 x 15 = 175: six fit (and a pass in four calls needs no more)
    (0.5, 200, 3),     # 100 + 2 x 50 = 200: three fit, four (250) do not
    (0.15, 100, 1),    # the largest call alone fills the budget
])
def test_each_layer_past_the_first_adds_its_growth_to_the_peak(growth, budget, expected):
    assert layers_per_graph(24, 100, budget, min_layers=2, growth=growth) == expected


def test_on_cpu_the_largest_calls_run_as_many_layers_per_graph_as_short_ones():
    """The CPU profile's measured growth: a 0.5B-shape's 256-token chunk and 16-sequence decode
    over 4,096 of context run six layers a graph, as a one-token decode does; with every
    layer's activations held (Ascend's unmeasured 1.0) the chunk would run two."""
    from msinfer.hardware import get_profile
    from msinfer.planning.workspace import stack_layers

    cpu = get_profile("cpu")
    config = load_config("qwen2-0.5b")
    shard = Strategy.default().resolve(config, "explicit")
    sizes = EngineLimits(max_model_len=4096, max_prefill_tokens=256, max_num_seqs=16)
    layers_for = stack_layers(shard, 4, sizes, min_layers=cpu.min_layers_per_graph,
                              growth=cpu.layer_peak_growth)
    assert layers_for(256, 1, 4096) == layers_for(16, 16, 4096) == layers_for(1, 1, 64) == 6
    held = stack_layers(shard, 4, sizes, min_layers=cpu.min_layers_per_graph)
    assert held(256, 1, 4096) == 2
