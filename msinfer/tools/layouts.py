"""`msinfer layouts`: checks, without Ascend, that every primitive of the semi_auto model
carries an in_strategy MindSpore 2.10 accepts for the shapes it is really called with.

No machine here can compile semi_auto for several ranks (MindSpore refuses it on CPU), so the
check is made on what the compiler would be handed. The semi_auto model is built stand-alone on
CPU, where shard() is recorded on each primitive but ignored; a prefill chunk and a decode step
are compiled with MindSpore's IR dump on; the graph after the `opt_a` pass group (the group
that runs step_parallel in a parallel job) is read back: every primitive call, its input
shapes, its `in_strategy`. Reading the IR, not wrapping Python calls, is what makes the check
complete: it sees the primitives MindSpore made of tensor methods, slicing and functional ops
too, so a primitive left without a strategy (which step_parallel would give its batch-parallel
default) cannot hide.

The rules are MindSpore 2.10's own (frontend/parallel/ops_info): OperatorInfo's
CheckStrategyByVector (one strategy per tensor input, its length the input's rank, each split a
divisor of its axis, powers of two on a power-of-two device count, a device count the splits
divide), MatMul/BatchMatMul (contracted axes split alike, batch axes alike), GatherInfo (a table
split on the gathered axis takes unsplit ids, except its 2-D "batch and axis" mode),
ScatterUpdateInfo (axis 0 of the input and the indices unsplit, the updates split as
indices + input[1:]), ArithmeticBase (equal splits where neither input broadcasts), Softmax
(its axis unsplit), StridedSlice (sliced axes unsplit), Concat (its axis unsplit, inputs alike);
QuantV2Info (an ArithmeticBase over x, scale, offset), and QuantBatchMatmulInfo /
WeightQuantBatchMatmulInfo (x and weight as MatMul; the later inputs laid out as the output's
columns; a bias under a split contracted axis added once per rank); and one of msinfer's
own: what the graph returns (the logits) is whole on every rank.

A quantized model is built with its Ascend methods (the primitives MindSpore shards), in
float16. They have no CPU kernel: its compile fails at kernel selection, after the STAGE
graph is written, and that failure alone is accepted (docs/quantization.md, "semi_auto").

The model is built small: each size a split could divide (vocabulary, intermediate size,
head_dim) becomes its gcd with L = lcm(1..max(8, world_size)), so every split of at most
world_size ranks divides it exactly when it divides the real size; the head and KV-head counts are the real
ones, and two decoder layers stand for all (one compiled Cell; the second shows that each
layer's cache is laid out alike).
"""
import contextlib
import dataclasses
import json
import math
import os
import re
import tempfile

from ..config import load_config
from ..engine_config import EngineLimits
from ..errors import MsinferError, PlanRefused
from ..parallel.strategy import checkpoint_parts, load_strategy

# Primitives that take no strategy: graph plumbing, and Reshape (whose layout MindSpore derives
# from its neighbours, inserting a redistribution where they disagree).
NO_STRATEGY = {"Load", "MakeTuple", "TupleGetItem", "UpdateState", "Depend", "Return",
               "Reshape"}
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "RealDiv", "Maximum", "Minimum", "Pow"}
STAGE = "opt_pass_2_opt_a_"  # the dump file after the opt_a group, where step_parallel runs
# The passes MindSpore dumps when MS_DEV_DUMP_IR_PASSES names them (it reads the variable once,
# at a process's first dump): the STAGE graph alone instead of ~100 files a compile, which
# took half of this check's time.
DUMP_PASSES = STAGE.rstrip("_")
ENGINE = dict(max_num_seqs=4, max_prefill_tokens=16, max_model_len=64)


@dataclasses.dataclass
class Call:
    """One primitive call of a compiled graph."""

    graph: str  # "decode" or "prefill"
    op: str  # primitive name, e.g. MatMul
    source: str  # msinfer file:line and statement that made it
    inputs: list  # shapes of its tensor inputs (a tuple input counts each element)
    output: tuple
    strategy: tuple = None  # in_strategy, None when not set
    args: str = ""  # the call's non-tensor arguments, as the IR writes them
    returned: bool = False  # its output leaves the graph

    def per_rank(self):
        if self.strategy is None or len(self.strategy) != len(self.inputs):
            return None
        return [tuple(n // s for n, s in zip(shape, split)) if len(shape) == len(split)
                else None for shape, split in zip(self.inputs, self.strategy)]


@dataclasses.dataclass(frozen=True)
class Violation:
    call: Call
    input: object  # index of the input, or None for the whole call
    rule: str

    def describe(self):
        where = f"input {self.input}" if self.input is not None else "call"
        return f"{self.call.op} at {self.call.source} ({self.call.graph}), {where}: {self.rule}"


# ---- the rules ----

def check(call: Call, device_num: int) -> list:
    """Every MindSpore rule `call` breaks with `device_num` devices."""
    if call.op in NO_STRATEGY or not call.inputs:
        return []
    if call.strategy is None:
        return [Violation(call, None, "no in_strategy: step_parallel would give it the "
                                      "batch-parallel default (axis 0 split over all devices)")]
    found = _check_values(call, device_num)
    if found:  # the op-specific rules read the strategy as well-formed
        return found
    rule = _OP_RULES.get(call.op)
    if rule is None and call.op in ELEMENTWISE:
        rule = _broadcast
    found = rule(call, device_num) if rule else []
    if call.returned and any(s != 1 for split in call.strategy for s in split):
        found.append(Violation(call, None, f"its output leaves the graph, split "
                                           f"{_fmt(call.strategy)}: each rank would return "
                                           f"only its slice"))
    return found


def _check_values(call, device_num):
    strategy, inputs = call.strategy, call.inputs
    if len(strategy) != len(inputs):
        return [Violation(call, None, f"in_strategy {_fmt(strategy)} has {len(strategy)} "
                                      f"entries for {len(inputs)} tensor inputs")]
    found = []
    power_of_two = device_num & (device_num - 1) == 0
    for i, (shape, split) in enumerate(zip(inputs, strategy)):
        if len(split) != len(shape):
            found.append(Violation(call, i, f"strategy {_fmt(split)} has {len(split)} entries "
                                            f"for a rank-{len(shape)} input {_fmt(shape)}"))
            continue
        for axis, (n, s) in enumerate(zip(shape, split)):
            if s < 1:
                found.append(Violation(call, i, f"split {s} of axis {axis} is not positive"))
            elif n % s:
                found.append(Violation(call, i, f"split {s} does not divide axis {axis} of "
                                                f"size {n} (shape {_fmt(shape)})"))
            elif power_of_two and s & (s - 1):
                found.append(Violation(call, i, f"split {s} of axis {axis} is not a power of "
                                                f"two ({device_num} devices)"))
        product = math.prod(split)
        if product > device_num or device_num % product:
            found.append(Violation(call, i, f"strategy {_fmt(split)} asks for {product} "
                                            f"devices, which do not divide the {device_num}"))
    return found


def _transposes(call):
    """(transpose of input 0, of input 1): a matmul's first two Bool arguments."""
    flags = [v == "1" for v in re.findall(r"Bool\((\d)\)", call.args)]
    if call.op == "BatchMatMul" and len(flags) < 2:
        return False, False
    return tuple((flags + [False, False])[:2])


def _matmul(call, device_num):
    a, b = call.strategy[:2]  # a quantized matmul's scales follow (_quant_matmul)
    transpose_a, transpose_b = _transposes(call)
    k_a = a[-2] if transpose_a else a[-1]
    k_b = b[-1] if transpose_b else b[-2]
    found = []
    if k_a != k_b:
        found.append(Violation(call, 1, f"the contracted axis is split {k_a} in input 0 but "
                                        f"{k_b} in input 1 (transpose_b={transpose_b})"))
    long, short = (a, b) if len(a) >= len(b) else (b, a)
    offset = len(long) - len(short)
    for j in range(len(short) - 2):
        if long[offset + j] != short[j]:
            found.append(Violation(call, None, f"batch axis {j} is split {long[offset + j]} "
                                               f"and {short[j]}: batch axes split alike"))
    return found


def _gather(call, device_num):
    table, ids = call.strategy
    numbers = [int(n) for n in re.findall(r"I64\((-?\d+)\)", call.args)]
    axis = numbers[0] if numbers else 0
    axis %= len(table)
    if table[axis] == 1:
        return []  # MindSpore's normal mode: any split of the ids and the other axes
    batch_and_axis = (axis == 0 and len(table) == 2 and len(ids) == 2 and table[1] == 1
                      and ids[1] == 1 and table[0] * ids[0] == device_num
                      and device_num not in (table[0], ids[0]))
    if batch_and_axis:
        return []
    found = []
    if len(call.inputs[0]) not in (1, 2):
        found.append(Violation(call, 0, f"the table is split on the gathered axis {axis}: "
                                        f"only a 1-D or 2-D table may be"))
    if math.prod(ids) != 1:
        found.append(Violation(call, 1, f"the table is split on the gathered axis {axis}, so "
                                        f"the indices cannot be split (got {_fmt(ids)}; both "
                                        f"split is MindSpore's 2-D 'batch and axis' mode only)"))
    repeated = math.prod(table) != device_num
    if repeated and axis != 0:
        found.append(Violation(call, 0, f"split on gathered axis {axis} != 0 cannot be "
                                        f"repeated over devices"))
    if repeated and axis == 0 and len(table) == 2 and table[1] != 1:
        found.append(Violation(call, 0, "split on axis 0 and axis 1 cannot be repeated over "
                                        "devices"))
    return found


def _scatter_update(call, device_num):
    table, indices, updates = call.strategy
    found = []
    if table[0] != 1:
        found.append(Violation(call, 0, "axis 0 (the rows ScatterUpdate writes) cannot be "
                                        "split"))
    if math.prod(indices) != 1:
        found.append(Violation(call, 1, "the indices cannot be split"))
    if tuple(updates) != tuple(indices) + tuple(table[1:]):
        found.append(Violation(call, 2, f"updates must be split as indices + input[1:] = "
                                        f"{_fmt(tuple(indices) + tuple(table[1:]))}, got "
                                        f"{_fmt(updates)}"))
    return found


def _broadcast(call, device_num):
    (a_shape, b_shape), (a, b) = call.inputs, call.strategy
    rank = max(len(a_shape), len(b_shape))
    a_shape, b_shape = _left_pad(a_shape, rank), _left_pad(b_shape, rank)
    a, b = _left_pad(a, rank), _left_pad(b, rank)
    return [Violation(call, None, f"axis {i} (sizes {a_shape[i]} and {b_shape[i]}) is split "
                                  f"{a[i]} and {b[i]}: where neither input broadcasts, the "
                                  f"splits must be equal")
            for i in range(rank) if a[i] != b[i] and a_shape[i] != 1 and b_shape[i] != 1]


def _softmax(call, device_num):
    (split,), rank = call.strategy, len(call.inputs[0])
    axes = [int(n) % rank for n in re.findall(r"I64\((-?\d+)\)", call.args)] or [rank - 1]
    return [Violation(call, 0, f"the softmax axis {axis} cannot be split")
            for axis in axes if split[axis] != 1]


def _strided_slice(call, device_num):
    (split,), (shape,) = call.strategy, call.inputs
    return [Violation(call, 0, f"axis {axis} is sliced ({shape[axis]} -> {call.output[axis]}) "
                               f"and cannot be split")
            for axis in range(len(shape))
            if split[axis] != 1 and axis < len(call.output) and call.output[axis] != shape[axis]]


def _concat(call, device_num):
    numbers = [int(n) for n in re.findall(r"I64\((-?\d+)\)", call.args)]
    rank = len(call.inputs[0])
    axis = (numbers[0] if numbers else 0) % rank
    found = [Violation(call, i, f"the concat axis {axis} cannot be split")
             for i, split in enumerate(call.strategy) if split[axis] != 1]
    if len(set(map(tuple, call.strategy))) > 1:
        found.append(Violation(call, None, "every input of Concat must be split alike"))
    return found


# MindSpore's quantized matmuls: positional inputs (None where not given), and which of them
# their op infos lay out by the output's column split.
QUANT_MATMULS = {
    # QuantBatchMatmul(x1, x2, scale, offset, bias, pertoken_scale, transpose_x1, ...)
    "QuantBatchMatmul": dict(bias=4, by_output=(2, 3, 4)),
    # WeightQuantBatchMatmul(x, weight, antiquant_scale, antiquant_offset, quant_scale,
    #                        quant_offset, bias, transpose_x, transpose_weight, group_size)
    "WeightQuantBatchMatmul": dict(bias=6, by_output=(2, 3, 4, 5, 6)),
}


def _quant_matmul(call, device_num):
    """QuantBatchMatmulInfo / WeightQuantBatchMatmulInfo (MindSpore 2.10): x and the weight
    as MatMul's (contracted axes alike, batch axes alike). Every input after them takes the
    tensor map of the output's last axis (a 1-D one of size 1 none; WeightQuantBatchMatmul's
    2-D group-wise ones the weight's), whatever its own in_strategy says, so msinfer asks
    that it say exactly that. A split contracted axis makes the op info insert an AllReduce
    (sum) after the op and nothing else: a bias given to the op would be added once per
    rank of that split."""
    found = _matmul(call, device_num)
    spec = QUANT_MATMULS[call.op]
    positions = _tensor_positions(call.args)
    a, b = call.strategy[:2]
    transpose_a, transpose_b = _transposes(call)
    k = a[-2] if transpose_a else a[-1]
    n = b[-2] if transpose_b else b[-1]
    for i, position in enumerate(positions):
        if i < 2 or position not in spec["by_output"]:
            continue
        shape, split = call.inputs[i], tuple(call.strategy[i])
        if len(shape) == 2:
            expected = tuple(b[-2:])
        else:
            expected = (1,) if shape == (1,) else (n,)
        if split != expected:
            found.append(Violation(call, i, f"{call.op} lays this input out as the output's "
                                            f"columns, {_fmt(expected)}, not {_fmt(split)}"))
    if k > 1 and spec["bias"] in positions:
        found.append(Violation(call, positions.index(spec["bias"]),
                               f"the contracted axis is split {k}: MindSpore sums the {k} "
                               f"partial products with an AllReduce after the op, so a bias "
                               f"given to the op is added {k} times"))
    return found


def _tensor_positions(args):
    """The positional index of each tensor input among a call's IR arguments (None, scalars
    and strings are not tensor inputs)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(args + ","):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(args[start:i].strip())
            start = i + 1
    scalar = re.compile(r"^(None|Bool\(|[IUF]\d+\(|\"|String)")
    return [n for n, item in enumerate(items) if item and not scalar.match(item)]


def _quant_v2(call, device_num):
    """QuantV2Info is AntiQuantInfo, an ArithmeticBase over (x, scale, offset): scale and
    offset broadcast against x, split alike where they do not."""
    found = []
    for i in (1, 2)[:len(call.inputs) - 1]:
        pair = dataclasses.replace(call, inputs=[call.inputs[0], call.inputs[i]],
                                   strategy=(call.strategy[0], call.strategy[i]))
        found += [dataclasses.replace(v, call=call, input=i) for v in _broadcast(pair, device_num)]
    return found


_OP_RULES = {"MatMul": _matmul, "BatchMatMul": _matmul, "Gather": _gather,
             "ScatterUpdate": _scatter_update, "Softmax": _softmax,
             "StridedSlice": _strided_slice, "Concat": _concat,
             "QuantBatchMatmul": _quant_matmul, "WeightQuantBatchMatmul": _quant_matmul,
             "QuantV2": _quant_v2}


def _left_pad(values, rank):
    return (1,) * (rank - len(values)) + tuple(values)


def _fmt(values):
    return "(" + ", ".join(str(v) if not isinstance(v, tuple) else _fmt(v)
                           for v in values) + ("," if len(values) == 1 else "") + ")"


# ---- reading the IR ----

_CALL = re.compile(r"^  %(\d+)\([^)]*\) = (?:PrimFunc_)?(\w+)\((.*)$")
_RETURN = re.compile(r"^  Return\(%(\d+)\)")


def parse_ir(text: str, graph: str) -> list:
    """The primitive calls of one dumped graph."""
    calls, ids = [], {}
    lines = text.splitlines()
    for n, line in enumerate(lines):
        returned = _RETURN.match(line)
        if returned:
            _mark_returned(returned.group(1), ids)
        found = _CALL.match(line)
        if not found or n + 1 >= len(lines) or not lines[n + 1].lstrip().startswith(": ("):
            continue
        node, op, rest = found.groups()
        arguments, attributes = _split_call(rest)
        inputs, output = _abstracts(lines[n + 1])
        strategy = None
        marker = attributes.find("in_strategy: ")
        if marker >= 0:
            strategy = _parse_tuple(_balanced(attributes, marker + len("in_strategy: ")))
        source = ""
        for comment in lines[n + 2:n + 40]:
            if not comment.lstrip().startswith("#"):
                break
            where = re.search(r"/(msinfer/[\w/]+\.py):(\d+)[^/]*/\s*(.*?)/?$", comment)
            if where:
                code = where.group(3).split("/<~~")[0].strip()  # drop MindSpore's remark
                source = f"{where.group(1).split('/', 1)[1]}:{where.group(2)} {code}"
        calls.append(Call(graph, op, source, inputs, output, strategy, arguments))
        ids[node] = calls[-1]
    return calls


def _mark_returned(node, ids):
    """Marks the calls whose outputs leave the graph: through a Depend (the logits wait for
    the cache writes) to its first input, through a MakeTuple to each."""
    call = ids.get(node)
    if call is None:
        return
    arguments = re.findall(r"%(\d+)", call.args)
    if call.op == "Depend" and arguments:
        _mark_returned(arguments[0], ids)
    elif call.op == "MakeTuple":
        for argument in arguments:
            _mark_returned(argument, ids)
    else:
        call.returned = True


def _split_call(rest):
    """`args) {instance...} primitive_attrs: {...}` -> (args, attributes)."""
    end = _closing(rest, 0, "(", ")", start_depth=1)
    return rest[:end], rest[end + 1:]


def _closing(text, start, opening, closing, start_depth=0):
    depth = start_depth
    for i in range(start, len(text)):
        if text[i] == opening:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def _balanced(text, start):
    return text[start:_closing(text, start, "(", ")") + 1]


def _parse_tuple(text):
    """`((1, 4), (4))` -> ((1, 4), (4,)): the IR writes one-element tuples without a comma,
    so the nesting of the parentheses, not Python's syntax, says what is a tuple."""
    stack = [[]]
    for token in re.findall(r"\(|\)|\d+", text):
        if token == "(":
            stack.append([])
        elif token == ")":
            done = tuple(stack.pop())
            stack[-1].append(done)
        else:
            stack[-1].append(int(token))
    return stack[0][0] if stack[0] else ()


def _abstracts(line):
    """`: (<in>, <in>, ...) -> (<out>)` -> ([tensor input shapes], output shape)."""
    body = line.split(": (", 1)[1]
    inputs_text, _, output_text = body.rpartition(") -> (")
    inputs = []
    for item in _top_level(inputs_text):
        if item.startswith(("<Tensor[", "<Ref[Tensor[")):
            inputs.append(_tensor_shape(item))
        elif item.startswith("<Tuple[Tensor["):
            start = item.index("TupleShape(") + len("TupleShape")
            inputs.extend(_parse_tuple(_balanced(item, start)))
    outputs = [_tensor_shape(i) for i in _top_level(output_text)
               if i.startswith(("<Tensor[", "<Ref[Tensor["))]
    return inputs, outputs[0] if outputs else ()


def _top_level(text):
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "<":
            depth += 1
            if depth == 1:
                start = i
        elif ch == ">":
            depth -= 1
            if depth == 0:
                items.append(text[start:i + 1])
    return items


_TENSOR = re.compile(r"^<(?:Ref\[)?Tensor\[\w+\]\]?, \(([-\d, ]*)\)")  # -1: a dynamic axis


def _tensor_shape(item):
    found = _TENSOR.match(item)
    if not found:
        raise ValueError(f"unexpected tensor abstract in the IR: {item[:80]}")
    return tuple(int(n) for n in found.group(1).split(",") if n.strip())


# ---- building the model small ----

def small_config(config, world_size):
    """`config` with two layers and every splittable size reduced to its gcd with
    lcm(1..max(8, world_size)): a split of up to world_size ranks divides the reduced size
    exactly when it divides the real one. Head and KV-head counts stay."""
    keep = math.lcm(*range(1, max(8, world_size) + 1))
    head_dim = math.gcd(config.head_dim, keep)
    if head_dim % 2:  # rotary halves the head
        head_dim *= 2
    return dataclasses.replace(
        config, num_layers=2, head_dim=head_dim, hidden_size=config.num_heads * head_dim,
        intermediate_size=math.gcd(config.intermediate_size, keep),
        vocab_size=math.gcd(config.vocab_size, keep))


class RawRulePlan:
    """A ShardPlan whose weight-consuming primitives take the strategy file's raw in_strategy
    verbatim, so that one msinfer would refuse is shown with what MindSpore would say."""

    def __init__(self, plan, raw):
        self._plan = plan
        self._raw = [(re.compile(re.escape(p).replace(r"\*", "[^.]*") + "$"), rule)
                     for p, rule in raw.items()]

    def __getattr__(self, name):
        return getattr(self._plan, name)

    def in_strategy(self, name):
        if name.endswith(".weight"):
            module = checkpoint_parts(name)[0].rsplit(".", 1)[0]
            for pattern, rule in self._raw:
                if pattern.match(module):
                    return rule
        return self._plan.in_strategy(name)


def resolve(strategy, config):
    """(plan for semi_auto, the raw rules, why the strategy parser refuses them or None).
    A raw rule msinfer does not run is replaced by its module's split style for building,
    and handed verbatim to the primitive."""
    from ..parallel import strategy as strategies

    raw = {p: r for p, r in strategy.rules.items() if not isinstance(r, str)}
    try:
        return strategy.resolve(config, "semi_auto"), raw, None
    except PlanRefused:
        raise
    except MsinferError as e:
        if not raw:
            raise
        refusal = str(e)
    modules = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in config.parameter_shapes()))
    styled = dict(strategy.rules)
    for pattern in raw:
        rx = re.compile(re.escape(pattern).replace(r"\*", "[^.]*") + "$")
        module = next((m for m in modules + ["lm_head"] if rx.match(m)), None)
        if module is None:
            raise MsinferError(refusal)
        styled[pattern] = strategies._ALLOWED[strategies._kind(module)][0]
    plan = dataclasses.replace(strategy, rules=styled).resolve(config, "semi_auto")
    return plan, raw, refusal


def record(config, plan, dtype, ir_dir):
    """Builds the semi_auto model stand-alone, compiles a decode step and a prefill chunk with
    the IR dump on, and returns their primitive calls."""
    import mindspore as ms

    from ..engine.model_runner import SemiAutoRunner
    from ..layers.parallel_context import ParallelContext
    from ..models.families import family_of
    from ..parallel.distributed import set_graph_mode
    from ..planning.kv_layout import CacheLayout

    set_graph_mode("CPU")
    ctx = ParallelContext(config=config, plan=plan, mode="semi_auto",
                          dtype=getattr(ms, dtype))
    layout = CacheLayout(config.num_layers, plan.local_kv_heads, config.head_dim,
                         block_size=16, num_blocks=8, dtype_bytes=4)
    shapes = config.parameter_shapes()
    family = family_of(config)  # Qwen2's or Qwen3's Cells and weight names
    names = ["model.embed_tokens.weight"] + family.head_weight_names(config)
    for layer in range(config.num_layers):
        names += family.layer_weight_names(layer)
    full = {n: (sum(shapes[p][0] for p in checkpoint_parts(n)),)
            + tuple(shapes[checkpoint_parts(n)[0]][1:]) for n in names}
    model = family.Model(ctx, layout, full)
    runner = SemiAutoRunner(ctx, layout, EngineLimits(**ENGINE), model=model)
    calls = []
    steps = (("decode", runner.batch_buckets[0]), ("prefill", runner.chunk_buckets[0]))
    for kind, size in steps:
        folder = os.path.join(ir_dir, kind)
        with dumping_ir(folder):
            try:
                runner.compile_shape(runner.shape_plan.at(kind, size,
                                                          runner.context_buckets[0]))
            except RuntimeError as e:
                if not ascend_only(e, folder):
                    raise
        with open(os.path.join(folder, stage_dumps(folder)[-1])) as f:
            calls += parse_ir(f.read(), kind)
    return calls


ASCEND_QUANTIZED = ("QuantV2", "QuantBatchMatmul", "WeightQuantBatchMatmul")


def ascend_only(error, folder):
    """Whether a compile failed only where a quantized model's Ascend primitives find no CPU
    kernel: at kernel selection, after the front end wrote the STAGE graph this check
    reads."""
    found = re.search(r"Unsupported op \[(\w+)\] on CPU", str(error))
    return (found is not None and found.group(1) in ASCEND_QUANTIZED
            and any(f.startswith(STAGE) for f in os.listdir(folder)))


@contextlib.contextmanager
def dumping_ir(folder):
    """MindSpore's IR dump into `folder` for what compiles inside: the STAGE graph (every
    pass's where this process dumped before without MS_DEV_DUMP_IR_PASSES)."""
    import mindspore as ms

    os.environ.setdefault("MS_DEV_DUMP_IR_PASSES", DUMP_PASSES)
    ms.set_context(save_graphs=1, save_graphs_path=str(folder))
    try:
        yield
    finally:
        ms.set_context(save_graphs=0)


def stage_dumps(folder):
    """The STAGE files under `folder`, in the order MindSpore wrote them."""
    dumps = sorted(f for f in os.listdir(folder) if f.startswith(STAGE))
    if not dumps:
        passes = os.environ.get("MS_DEV_DUMP_IR_PASSES")
        raise RuntimeError(f"MindSpore wrote no {STAGE}*.ir under {folder}"
                           + (f" (MS_DEV_DUMP_IR_PASSES={passes} leaves it out?)"
                              if passes and DUMP_PASSES not in passes else ""))
    return dumps


def run(model, strategy_path, hardware="cpu"):
    """The report of `msinfer layouts` as a dict."""
    from ..hardware import compute_dtype, get_profile

    config = load_config(model)
    strategy = load_strategy(strategy_path)
    profile = get_profile(hardware)
    dtype, _ = compute_dtype(profile, config.torch_dtype)
    report = {"model": config.source, "strategy": strategy_path, "hardware": hardware,
              "dtype": dtype, "tensor": strategy.tensor, "data": strategy.data,
              "world_size": strategy.world_size}
    try:
        resolve(strategy, config)
    except PlanRefused as e:
        report["refused"] = str(e)
        return report
    small = dataclasses.replace(small_config(config, strategy.world_size),
                                source=f"{config.source} (reduced)")
    plan, raw, refusal = resolve(strategy, small)
    if raw:
        plan = RawRulePlan(plan, raw)
    report["built"] = {k: getattr(small, k) for k in (
        "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
        "intermediate_size", "vocab_size")}
    report["raw_rules_refused_by_msinfer"] = refusal
    # bfloat16 does not run on CPU; float16 makes the same graph (the same float32 casts).
    # A quantized model is built with its Ascend kernels, which compute in float16.
    quantized = config.quantization is not None
    report["built"]["dtype"] = "float16" if dtype == "bfloat16" or quantized else dtype
    with tempfile.TemporaryDirectory(prefix="msinfer-layouts-") as ir_dir:
        calls = record(small, plan, report["built"]["dtype"], ir_dir)
    report["calls"] = calls
    report["violations"] = [v for c in calls for v in check(c, strategy.world_size)]
    return report


# ---- output ----

def format_report(report):
    head = (f"msinfer layouts: {report['model']} with {report['strategy']} (semi_auto, "
            f"tensor {report['tensor']} x data {report['data']} = {report['world_size']} "
            f"devices, {report['dtype']})")
    if "refused" in report:
        return f"{head}\nREFUSED: {report['refused']}"
    b = report["built"]
    lines = [head, f"built stand-alone on CPU in {b['dtype']}: {b['num_layers']} layers, "
                   f"{b['num_heads']} heads, "
                   f"{b['num_kv_heads']} KV heads, head_dim {b['head_dim']}, hidden "
                   f"{b['hidden_size']}, intermediate {b['intermediate_size']}, vocab "
                   f"{b['vocab_size']} (sizes reduced to their gcd with lcm(1.."
                   f"{max(8, report['world_size'])}): the same splits divide them)", ""]
    rows = [("graph", "op (source)", "input shapes", "in_strategy", "per-rank shapes")]
    seen = set()
    for c in report["calls"]:
        if c.op in NO_STRATEGY:
            continue
        key = (c.graph, c.op, c.source, str(c.inputs), str(c.strategy))
        if key in seen:
            continue
        seen.add(key)
        per_rank = c.per_rank()
        rows.append((c.graph, f"{c.op} ({c.source.split(' ', 1)[0]})",
                     " ".join(_fmt(s) for s in c.inputs),
                     _fmt(c.strategy) if c.strategy is not None else "-",
                     " ".join(_fmt(s) if s is not None else "?" for s in per_rank)
                     if per_rank else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])
    lines.append("")
    checked = sum(1 for c in report["calls"] if c.op not in NO_STRATEGY)
    if report["raw_rules_refused_by_msinfer"]:
        lines.append(f"note: msinfer itself refuses this strategy: "
                     f"{report['raw_rules_refused_by_msinfer']}")
    if report["violations"]:
        lines.append(f"{len(report['violations'])} violation(s) of MindSpore's rules:")
        lines += [f"  {v.describe()}" for v in report["violations"]]
    else:
        lines.append(f"clean: {checked} primitive calls, each with an in_strategy MindSpore "
                     f"accepts for its input shapes")
    return "\n".join(lines)


def to_json(report):
    out = {k: v for k, v in report.items() if k not in ("calls", "violations")}
    if "calls" in report:
        out["calls"] = [{"graph": c.graph, "op": c.op, "source": c.source,
                         "inputs": c.inputs, "in_strategy": c.strategy,
                         "per_rank": c.per_rank()} for c in report["calls"]
                        if c.op not in NO_STRATEGY]
        out["violations"] = [{"op": v.call.op, "source": v.call.source, "graph": v.call.graph,
                              "input": v.input, "rule": v.rule} for v in report["violations"]]
    return json.dumps(out, indent=2)
