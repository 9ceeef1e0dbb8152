"""`msinfer commtest`: time and check the collectives a sharded model uses, on its own groups.

Runs inside every rank, like `generate` (`msinfer launch --nproc 4 -- commtest`, mpirun,
msrun or a rank table). AllReduce and AllGather (no Broadcast: 310P's HCCL has none) over
message sizes from --min-bytes to --max-bytes, on the world group, on each tensor group of
the strategy and, on a 300I Duo, on same-card and cross-card pairs of chips. The figures
follow nccl-tests / hccl_test:

- size: AllReduce, the bytes each rank sends (= what it receives); AllGather, the bytes each
  rank receives (the whole gathered tensor, n x what it sends);
- time: wall clock per call, averaged over --iters back-to-back calls that sit between two
  barriers (a tiny AllReduce read back to the host), slowest rank of the measurement;
- algbw = size / time; busbw = algbw x 2(n-1)/n for AllReduce, algbw x (n-1)/n for
  AllGather, n = ranks in the group: the figure to hold against the link's bandwidth;
- check: every rank compares its last result with the exact expected values
  ("success"/"failed", as hccl_test prints). Rank 0 prints the report; once it has, the job
  exits 1 if a check failed.

Test hook: MSINFER_TEST_CORRUPT_RANK=r makes rank r contribute a wrong value, so every
measurement it takes part in must read "failed".
"""
import gc
import json
import math
import os
import re
import time

import numpy as np

from .. import log
from ..errors import MsinferError

OPS = ("AllReduce", "AllGather")
DTYPES = {"float32": np.float32, "float16": np.float16}
_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
DEFINITIONS = {
    "size": "AllReduce: bytes each rank sends and receives; AllGather: bytes each rank "
            "receives (the gathered tensor), as nccl-tests",
    "time_us": "wall clock per call, mean of --iters back-to-back calls between two barriers "
               "(a tiny AllReduce read back to the host); slowest rank",
    "algbw": "size / time, GB/s (1e9 bytes/s)",
    "busbw": "nccl-tests bus bandwidth: AllReduce algbw*2(n-1)/n, AllGather algbw*(n-1)/n, "
             "n = ranks per group",
    "check": "every rank's last result equals the expected values exactly",
}


def parse_size(text):
    found = re.fullmatch(r"\s*([0-9]+)\s*([KMG]?)B?\s*", str(text).upper())
    if not found or int(found[1]) < 1:
        raise MsinferError(f"size {text!r}: expected a positive number of bytes, e.g. 8, 64K, "
                           f"64M")
    return int(found[1]) * _UNITS[found[2]]


def message_sizes(min_bytes, max_bytes, factor):
    if factor < 2:
        raise MsinferError(f"--factor {factor}: must be at least 2")
    if min_bytes > max_bytes:
        raise MsinferError(f"--min-bytes {min_bytes} exceeds --max-bytes {max_bytes}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def elements(op, size, itemsize, n):
    """(elements each rank sends, bytes as reported) for a requested message size."""
    if op == "AllReduce":
        count = max(1, size // itemsize)
        return count, count * itemsize
    count = max(1, size // (itemsize * n))
    return count, count * n * itemsize


def bandwidths(op, size, seconds, n):
    """nccl-tests' algorithm and bus bandwidth in GB/s."""
    algbw = size / seconds / 1e9
    factor = 2 * (n - 1) / n if op == "AllReduce" else (n - 1) / n
    return algbw, algbw * factor


def contribution(rank, count, dtype, corrupt=False):
    """What `rank` sends: small integers, exact in float16 and in any sum of a few ranks."""
    x = ((rank + 1) + np.arange(count) % 7).astype(dtype)
    if corrupt:
        x[0] += 1
    return x


def expected(op, ranks, count, dtype):
    parts = [contribution(r, count, dtype) for r in ranks]
    return np.sum(parts, axis=0).astype(dtype) if op == "AllReduce" else np.concatenate(parts)


def pair_groups(chips, per_card=2):
    """Same-card and cross-card pairs of ranks, from each rank's chip (device) id.

    Chips d and d' share a card when d // per_card == d' // per_card. Cross-card pairs join
    chip i of one card with chip i of the next card (cards taken two by two), so both kinds
    pair every rank at most once and run side by side, as a tensor group's ranks do."""
    cards = {}
    for rank, chip in enumerate(chips):
        cards.setdefault(chip // per_card, []).append(rank)
    same = [sorted(ranks, key=lambda r: chips[r]) for ranks in cards.values()
            if len(ranks) == per_card]
    ordered = [cards[c] for c in sorted(cards) if len(cards[c]) == per_card]
    cross = []
    for a, b in zip(ordered[0::2], ordered[1::2]):
        a, b = sorted(a, key=lambda r: chips[r]), sorted(b, key=lambda r: chips[r])
        cross += [[x, y] for x, y in zip(a, b)]
    return {"same-card pairs": same, "cross-card pairs": cross}


def run(args):
    from ..hardware import get_profile
    from ..parallel.distributed import all_gather_rows, init_distributed, leave_mpirun_job

    profile = get_profile(args.hardware)
    min_bytes = parse_size(args.min_bytes)
    max_bytes = parse_size(args.max_bytes or ("1M" if profile.device_target == "CPU" else "64M"))
    sizes = message_sizes(min_bytes, max_bytes, args.factor)
    if args.iters < 1 or args.warmup < 0:
        raise MsinferError(f"--iters {args.iters} / --warmup {args.warmup}: need iters >= 1 "
                           f"and warmup >= 0")
    dtype = args.dtype or next((d for d in profile.dtypes if d in DTYPES), "float16")
    strategy, plan = _strategy_and_plan(args)
    info = init_distributed(profile.device_target, strategy.world_size, args.rank_table)
    # MindSpore collects garbage before compiling each graph (one per op, group and size):
    # what exists now (MindSpore, msinfer) lives to the end, so out of those collections.
    gc.freeze()
    if info.world_size < 2:
        raise MsinferError("commtest needs at least 2 ranks: start it with `msinfer launch "
                           "--nproc N [--strategy S] -- commtest`")
    corrupt = os.environ.get("MSINFER_TEST_CORRUPT_RANK") == str(info.rank)
    if corrupt:
        log.get().warning("test hook: rank %d contributes a wrong value", info.rank)

    chips = all_gather_rows(np.array([[info.device_id]], np.float32))[:, 0].astype(int).tolist()
    chips_note = None
    if len(set(chips)) < len(chips):  # CPU, or a launcher that set no DEVICE_ID
        chips, chips_note = list(range(info.world_size)), "chip ids taken as rank numbers"
    groups, skipped, names = _groups(info, plan, chips, profile, args.pairs)

    runner = _Runner(info, DTYPES[dtype], args.iters, args.warmup, corrupt, names)
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    results = []
    for scope, members in groups.items():
        mine = next((g for g in members if info.rank in g), None)
        n = len(members[0])
        for op in OPS:
            if op == "AllGather" and scope != "world" and profile.device_target == "CPU":
                continue  # listed in `skipped` by _groups
            # Small sizes can round to one message (AllGather sends at least one element
            # per rank): measure each once.
            messages = dict.fromkeys(elements(op, size, itemsize, n) for size in sizes)
            for count, nbytes in messages:
                results.append(runner.measure(scope, op, count, nbytes, n, mine))

    # One gather carries every rank's time and verdict to every rank.
    local = np.array([[r["time_s"], r["ok"], r["bad_source"]] for r in results], np.float32)
    table = all_gather_rows(local.reshape(1, -1)).reshape(info.world_size, len(results), 3)
    report = _report(info, profile, dtype, args, groups, skipped, results, table, chips,
                     chips_note)
    if args.model:
        report["model_estimate"] = model_estimate(args.model, strategy, profile, dtype,
                                                  report["results"])
    code = 0
    if info.rank == 0:
        text = json.dumps(report, indent=2)
        if args.output:
            try:
                with open(args.output, "w") as f:
                    f.write(text + "\n")
            except OSError as e:
                raise MsinferError(f"--output {args.output}: {e.strerror}") from None
        print(text if args.json else format_report(report), flush=True)
        code = 0 if report["ok"] else 1
    elif not report["ok"]:
        log.get().error("checks failed; rank 0 prints which")
    # Nobody leaves before rank 0 has printed: a launcher aborts every rank as soon as one
    # exits non-zero.
    all_gather_rows(np.zeros((1, 1), np.float32))
    if not report["ok"] and info.launcher.startswith("mpirun"):
        leave_mpirun_job(1)  # every rank, so that none is aborted mid-teardown
    return code


def _strategy_and_plan(args):
    from ..config import load_config
    from ..parallel.strategy import Strategy, load_strategy

    if args.strategy:
        strategy = load_strategy(args.strategy)
    else:
        strategy = Strategy.default(tensor=_job_size())  # the world is the tensor group
    # Only the strategy's groups matter here, whatever --model is (a model the strategy
    # cannot split is said in the estimate): qwen2-72b splits any tensor degree up to 16.
    return strategy, strategy.resolve(load_config("qwen2-72b"))


def _job_size():
    """The number of ranks the launcher started, read before joining the job."""
    from ..parallel.distributed import mpi_world

    world = mpi_world()
    if world:
        return world[1]
    for key in ("MS_WORKER_NUM", "RANK_SIZE"):  # msrun; rank-table processes
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 1


def _groups(info, plan, chips, profile, pairs):
    """{scope: [ranks of each group]} measured, what is not measured and why, and the name
    of this rank's tensor group (created by the model's own `tensor_group`)."""
    from ..parallel.distributed import tensor_group

    world = list(range(info.world_size))
    groups = {"world": [world]}
    skipped, names = [], {}
    name = tensor_group(info, plan)
    if name is None:
        skipped.append({"scope": "tensor groups", "reason": (
            "the tensor group is the world group" if plan.tensor > 1
            else "tensor = 1: the model runs no collective inside a replica")})
    else:
        groups["tensor groups"] = [list(range(d * plan.tensor, (d + 1) * plan.tensor))
                                   for d in range(plan.data)]
        names[tuple(groups["tensor groups"][plan.data_rank(info.rank)])] = name
    if pairs or profile.devices_per_card == 2:
        for scope, members in pair_groups(chips).items():
            if members:
                groups[scope] = members
            else:
                skipped.append({"scope": scope, "reason": "no two chips of the job form one"})
    if profile.device_target == "CPU":
        for scope in groups:
            if scope != "world":
                skipped.append({"scope": scope, "op": "AllGather", "reason": (
                    "MindSpore's CPU AllGather runs on the world group only")})
    return groups, skipped, names


class _Runner:
    """Times one collective per (group, size) with GRAPH_MODE Cells, one Cell per op and
    group (a new message size recompiles the graph, during warmup)."""

    def __init__(self, info, dtype, iters, warmup, corrupt, group_names):
        self.info, self.dtype, self.iters, self.warmup = info, dtype, iters, warmup
        self.corrupt = corrupt
        self.group_names = dict(group_names)  # (ranks,) -> communication group, made once
        self.cells = {}

    def measure(self, scope, op, count, nbytes, n, mine):
        entry = {"scope": scope, "op": op, "size": nbytes, "count": count, "ranks": n,
                 "time_s": math.nan, "ok": math.nan, "bad_source": math.nan}
        self._barrier(None)  # every group starts together, as in a sharded model's step
        if mine is None:
            return entry
        group = self._group(mine)
        cell = self._cell(op, group)
        x = self._tensor(contribution(self.info.rank, count, self.dtype, self.corrupt))
        for _ in range(max(1, self.warmup)):  # the first call compiles this size's graph
            cell(x)
        self._barrier(group)
        start = time.perf_counter()
        for _ in range(self.iters):
            out = cell(x)
        self._barrier(group)
        entry["time_s"] = (time.perf_counter() - start) / self.iters
        got, want = out.asnumpy().reshape(-1), expected(op, mine, count, self.dtype)
        entry["ok"] = float(np.array_equal(got, want))
        if op == "AllGather" and not entry["ok"]:  # the wrong segment names its sender
            wrong = np.any(got.reshape(n, count) != want.reshape(n, count), axis=1)
            entry["bad_source"] = float(mine[int(np.argmax(wrong))])
        return entry

    def _group(self, ranks):
        if len(ranks) == self.info.world_size:
            return None
        key = tuple(ranks)
        if key not in self.group_names:
            from mindspore.communication import create_group
            name = "msinfer_commtest_" + "_".join(map(str, ranks))
            create_group(name, list(ranks))
            self.group_names[key] = name
        return self.group_names[key]

    def _cell(self, op, group):
        key = (op, group)
        if key not in self.cells:
            from mindspore import nn, ops
            from mindspore.ops import ReduceOp

            primitive = (ops.AllReduce(ReduceOp.SUM, **_group_kw(group)) if op == "AllReduce"
                         else ops.AllGather(**_group_kw(group)))

            class Collective(nn.Cell):
                def __init__(self, op):
                    super().__init__()
                    self.op = op

                def construct(self, x):
                    return self.op(x)

            self.cells[key] = Collective(primitive)
        return self.cells[key]

    def _barrier(self, group):
        # float32: MindSpore's CPU AllReduce takes no int32
        self._cell("AllReduce", group)(self._tensor(np.ones(1, np.float32))).asnumpy()

    @staticmethod
    def _tensor(array):
        from mindspore import Tensor
        return Tensor(array)


def _group_kw(group):
    return {"group": group} if group else {}


def _report(info, profile, dtype, args, groups, skipped, results, table, chips, chips_note):
    rows = []
    for i, r in enumerate(results):
        times, oks, sources = table[:, i, 0], table[:, i, 1], table[:, i, 2]
        ran = ~np.isnan(times)
        seconds = float(times[ran].max())
        algbw, busbw = bandwidths(r["op"], r["size"], seconds, r["ranks"])
        rows.append({"group": r["scope"], "op": r["op"], "ranks_per_group": r["ranks"],
                     "groups": len(groups[r["scope"]]), "size_bytes": r["size"],
                     "count": r["count"], "time_us": round(seconds * 1e6, 3),
                     "algbw_gbps": algbw, "busbw_gbps": busbw,
                     "check": "success" if bool(np.all(oks[ran] == 1)) else "failed",
                     "failed_ranks": [int(k) for k in np.nonzero(ran & (oks != 1))[0]],
                     "wrong_senders": sorted({int(k) for k in sources[~np.isnan(sources)]})})
    return {
        "ok": all(row["check"] == "success" for row in rows),
        "world_size": info.world_size, "launcher": info.launcher, "hardware": profile.name,
        "device_target": profile.device_target, "dtype": dtype, "iters": args.iters,
        "warmup": args.warmup, "strategy": args.strategy, "chips": chips,
        "chips_note": chips_note, "groups": groups, "skipped": skipped,
        "definitions": DEFINITIONS, "results": rows,
    }


def format_report(report):
    lines = [
        f"# msinfer commtest: {report['world_size']} ranks ({report['launcher']}), "
        f"{report['hardware']}, {report['dtype']}, {report['iters']} iters after "
        f"{report['warmup']} warmup",
        "# time: mean per call between two barriers, slowest rank; algbw = size / time;",
        "# busbw (nccl-tests): AllReduce algbw*2(n-1)/n, AllGather algbw*(n-1)/n;",
        "# size: AllReduce bytes per rank, AllGather bytes gathered (output), as nccl-tests",
    ]
    for scope, members in report["groups"].items():
        lines.append(f"# {scope}: " + " ".join("(" + ",".join(map(str, g)) + ")"
                                               for g in members))
    for skip in report["skipped"]:
        what = f"{skip['op']} on {skip['scope']}" if "op" in skip else skip["scope"]
        lines.append(f"# not measured: {what}: {skip['reason']}")
    header = (f"{'group':<17} {'op':<10} {'n':>2} {'size(B)':>10} {'count':>9} "
              f"{'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}  check")
    lines += [header, "-" * len(header)]
    for row in report["results"]:
        lines.append(
            f"{row['group']:<17} {row['op']:<10} {row['ranks_per_group']:>2} "
            f"{row['size_bytes']:>10} {row['count']:>9} {row['time_us']:>11.2f} "
            f"{row['algbw_gbps']:>12.4g} {row['busbw_gbps']:>12.4g}  {row['check']}")
    lines += _pair_summary(report["results"])
    lines += _estimate_lines(report.get("model_estimate"))
    failed = [r for r in report["results"] if r["check"] == "failed"]
    if failed:
        ranks = sorted({k for r in failed for k in r["failed_ranks"]})
        senders = sorted({k for r in failed for k in r["wrong_senders"]})
        blame = (f"; AllGather shows rank {', '.join(map(str, senders))}'s contribution wrong"
                 if senders else "")
        lines.append(f"FAILED: {len(failed)} of {len(report['results'])} checks; wrong results "
                     f"on rank {', '.join(map(str, ranks))}{blame}")
    else:
        lines.append(f"all {len(report['results'])} checks: success")
    return "\n".join(lines)


def model_estimate(model, strategy, profile, dtype, rows):
    """The collectives one decoded token of `model` costs (batch 1 per replica, from the
    planner), each timed at the measured size nearest above its payload, in the tensor group
    (or the world when that is the tensor group)."""
    from ..config import load_config
    from ..engine_config import EngineLimits
    from ..planning.planner import make_plan

    # One sequence per data replica: replicas decode side by side, each in its own group.
    config = load_config(model)
    plan = make_plan(config, strategy, profile, EngineLimits.for_model(config, max_num_seqs=1),
                     dtype)
    estimate = {"model": model, "batch": 1, "dtype": dtype, "collectives": [],
                "total_us": 0.0, "note": None}
    if not plan.collectives_per_token:
        estimate["note"] = (plan.errors[0] if plan.errors
                            else "tensor = 1: no collective per token")
        return estimate
    scope = "tensor groups" if any(r["group"] == "tensor groups" for r in rows) else "world"
    for c in plan.collectives_per_token:
        measured = sorted((r for r in rows if r["group"] == scope and r["op"] == c.kind),
                          key=lambda r: r["size_bytes"])
        entry = {"op": c.kind, "count": c.count, "payload_bytes": c.payload_bytes,
                 "where": c.where, "group": scope, "each_us": None, "measured_at_bytes": None}
        if measured:
            above = next((r for r in measured if r["size_bytes"] >= c.payload_bytes), None)
            if above is None:  # beyond the sweep: scale the largest by size (bandwidth-bound)
                above = measured[-1]
                each = above["time_us"] * c.payload_bytes / above["size_bytes"]
            else:
                each = above["time_us"]
            entry.update(each_us=each, measured_at_bytes=above["size_bytes"])
            estimate["total_us"] += c.count * each
        estimate["collectives"].append(entry)
    return estimate


def _estimate_lines(estimate):
    if estimate is None:
        return []
    if estimate["note"]:
        return [f"# {estimate['model']}: no estimate: {estimate['note']}"]
    parts = []
    for c in estimate["collectives"]:
        if c["each_us"] is None:
            parts.append(f"{c['op']} x{c['count']} of {c['payload_bytes']} B: not measured on "
                         f"{c['group']}")
        else:
            parts.append(f"{c['op']} x{c['count']} of {c['payload_bytes']} B ~ "
                         f"{c['count']} x {c['each_us']:.1f} us (measured at "
                         f"{c['measured_at_bytes']} B)")
    return [f"# per decoded token of {estimate['model']} (batch 1 per replica, "
            f"{estimate['dtype']}, "
            f"{estimate['collectives'][0]['group']}): " + "; ".join(parts)
            + f"; collectives ~ {estimate['total_us'] / 1000:.2f} ms per token"]


def _pair_summary(rows):
    """Same-card vs cross-card AllReduce at the largest size both measured."""
    by = {g: {r["size_bytes"]: r for r in rows if r["group"] == g and r["op"] == "AllReduce"}
          for g in ("same-card pairs", "cross-card pairs")}
    common = set(by["same-card pairs"]) & set(by["cross-card pairs"])
    if not common:
        return []
    size = max(common)
    same, cross = by["same-card pairs"][size], by["cross-card pairs"][size]
    return [f"# pairs at {size} B AllReduce: same-card busbw {same['busbw_gbps']:.4f} GB/s, "
            f"cross-card {cross['busbw_gbps']:.4f} GB/s "
            f"(cross / same = {cross['busbw_gbps'] / same['busbw_gbps']:.2f})"]
