"""The KV cache's block arithmetic and the scheduler's decisions, without a model.

A fake forward pass moves `computed` and appends a token, as the engine does after sampling,
so whole runs of the scheduler can be checked for what a serving engine promises: FCFS
admission within the chunk budget and the sequence slots, decodes every step, blocks freed
at once, preemption of the latest admitted when blocks run out, and identical decisions when
replayed (what keeps the ranks of a sharded job in lockstep).
"""
import numpy as np
import pytest

from msinfer.engine.block_manager import BlockManager
from msinfer.engine.sampling import SamplingParams
from msinfer.engine.scheduler import Scheduler
from msinfer.engine.sequence import Sequence, Status
from msinfer.engine_config import EngineLimits
from msinfer.errors import MsinferError
from msinfer.planning.kv_layout import TRASH_BLOCK, CacheLayout


def layout(blocks, block_size=4):
    return CacheLayout(num_layers=2, kv_heads=2, head_dim=8, block_size=block_size,
                       num_blocks=blocks, dtype_bytes=4)


def seq(name, prompt_len, max_tokens=8):
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def run_step(scheduler, done=()):
    """One engine step with a fake model: every chunk and decode is computed, sequences that
    finish their pending tokens get a token; those in `done` then finish."""
    schedule = scheduler.schedule()
    for chunk in schedule.chunks:
        chunk.seq.computed += chunk.count
        if chunk.completes:
            chunk.seq.generated.append(7)
    for s in schedule.decodes:
        s.computed += 1
        s.generated.append(7)
    for s in list(scheduler.running):
        if s.request_id in done or len(s.generated) >= s.params.max_tokens:
            s.status = Status.FINISHED
            scheduler.remove(s)
    return schedule


def test_slots_follow_the_block_table_in_each_layers_tensors():
    cache = layout(blocks=10, block_size=4)
    assert cache.shape == (40, 2, 8)  # one layer's K (or V)
    assert cache.slots([3, 7], [0, 3, 4, 6]).tolist() == [12, 15, 28, 30]
    assert cache.usable_tokens == 36  # the trash block is never handed out
    assert cache.total_bytes == 2 * 2 * 40 * 2 * 8 * 4


def test_explicit_modes_rows_hold_each_slots_heads_and_read_them_by_head():
    """The cache as rows of one head's vector (explicit mode): a token written at its slot's
    head_rows is that slot's (kv_heads, head_dim) of the (slots, kv_heads, head_dim) cache, and
    one gather at rows_by_head is the slots' context put by head, (groups, kv_heads, T,
    head_dim), with no transpose."""
    cache = layout(blocks=10, block_size=4)
    assert cache.rows_shape == (40 * 2, 8)
    rng = np.random.default_rng(0)
    k = rng.standard_normal(cache.shape)
    rows = k.reshape(cache.rows_shape).copy()
    written = rng.standard_normal((2, cache.kv_heads, cache.head_dim))
    rows[cache.head_rows([9, 33])] = written.reshape(-1, cache.head_dim)
    k[[9, 33]] = written
    np.testing.assert_array_equal(rows, k.reshape(cache.rows_shape))
    slots = np.array([[5, 6, 9], [33, 2, 0]])  # two groups of three context slots
    read = rows[cache.rows_by_head(slots.reshape(-1), groups=2)]
    np.testing.assert_array_equal(read.reshape(2, cache.kv_heads, 3, cache.head_dim),
                                  k[slots].transpose(0, 2, 1, 3))


def test_budget_sizes_the_pool_and_too_small_a_budget_is_a_clear_error():
    per_block = CacheLayout.bytes_per_block(2, 2, 8, 4, 4)
    assert CacheLayout.from_budget(10 * per_block + 5, 2, 2, 8, 4, 4).num_blocks == 10
    assert CacheLayout.from_budget(10 * per_block, 2, 2, 8, 4, 4, max_blocks=3).num_blocks == 4
    with pytest.raises(MsinferError, match="at least 2"):
        CacheLayout.from_budget(per_block + 1, 2, 2, 8, 4, 4)


def test_block_manager_never_hands_out_the_trash_block_and_takes_blocks_back():
    blocks = BlockManager(layout(blocks=4))
    s = seq("a", 9)
    assert blocks.can_hold(s, 12) and not blocks.can_hold(s, 13)
    blocks.grow(s, 9)
    assert len(s.block_table) == 3 and TRASH_BLOCK not in s.block_table
    assert blocks.num_used == 3
    blocks.release(s)
    assert blocks.num_used == 0 and s.block_table == []


def test_chunks_fill_the_budget_in_arrival_order_and_long_prompts_continue():
    scheduler = Scheduler(BlockManager(layout(blocks=64)), EngineLimits(
                          max_num_seqs=8, max_prefill_tokens=16))
    for i, n in enumerate((10, 30, 3)):
        scheduler.add(seq(f"s{i}", n))
    first = scheduler.schedule()
    assert [(c.seq.request_id, c.start, c.count) for c in first.chunks] == [("s0", 0, 10),
                                                                            ("s1", 0, 6)]
    assert [c.completes for c in first.chunks] == [True, False]
    for c in first.chunks:
        c.seq.computed += c.count
    first.chunks[0].seq.generated.append(7)
    second = scheduler.schedule()
    assert [s.request_id for s in second.decodes] == ["s0"]
    assert [(c.seq.request_id, c.start, c.count) for c in second.chunks] == [("s1", 6, 16)]
    assert list(scheduler.waiting)[0].request_id == "s2"  # budget spent: it waits


def test_max_num_seqs_and_free_blocks_gate_admission_and_nothing_overtakes_the_head():
    scheduler = Scheduler(BlockManager(layout(blocks=5)), EngineLimits(
                          max_num_seqs=2, max_prefill_tokens=64))
    scheduler.add(seq("big", 12))  # 3 of the 4 usable blocks
    scheduler.add(seq("too-big-now", 8))  # 2 blocks: does not fit yet
    scheduler.add(seq("small", 2))  # would fit, but must not overtake
    schedule = scheduler.schedule()
    assert [c.seq.request_id for c in schedule.chunks] == ["big"]
    assert [s.request_id for s in scheduler.waiting] == ["too-big-now", "small"]


def test_a_sequence_out_of_blocks_preempts_the_latest_admitted_which_resumes_first():
    scheduler = Scheduler(BlockManager(layout(blocks=5)), EngineLimits(
                          max_num_seqs=4, max_prefill_tokens=64))
    a, b = seq("a", 4, max_tokens=10), seq("b", 4, max_tokens=10)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # both prefilled: 1 block each, 5 tokens each
    assert scheduler.blocks.num_used == 2
    preempted = []
    for _ in range(6):
        preempted += run_step(scheduler).preempted
    assert preempted and preempted[0] is b  # the latest admitted goes
    assert b.preemptions >= 1 and scheduler.preemptions >= 1
    assert b.computed == 0 or b.status is Status.RUNNING  # recomputed from scratch
    while scheduler.has_work():
        run_step(scheduler)
    assert len(a.generated) == len(b.generated) == 10
    assert scheduler.blocks.num_used == 0


def test_finished_sequences_free_their_blocks_at_once():
    scheduler = Scheduler(BlockManager(layout(blocks=16)), EngineLimits(
                          max_num_seqs=4, max_prefill_tokens=64))
    scheduler.add(seq("a", 6))
    run_step(scheduler)
    used = scheduler.blocks.num_used
    assert used == 2
    run_step(scheduler, done=("a",))
    assert scheduler.blocks.num_used == 0 and not scheduler.has_work()


def test_same_requests_same_order_give_the_same_decisions():
    """Every rank replays the same add calls: the schedules must be identical."""
    def replay():
        rng = np.random.default_rng(0)
        scheduler = Scheduler(BlockManager(layout(blocks=12)), EngineLimits(
                              max_num_seqs=3, max_prefill_tokens=8))
        trace = []
        for step in range(60):
            if step % 3 == 0:
                scheduler.add(seq(f"r{step}", int(rng.integers(1, 14)),
                                  max_tokens=int(rng.integers(1, 9))))
            s = run_step(scheduler)
            trace.append(([x.request_id for x in s.decodes],
                          [(c.seq.request_id, c.start, c.count) for c in s.chunks],
                          [x.request_id for x in s.preempted]))
        return trace

    assert replay() == replay()


def test_chunks_of_one_step_attend_within_the_largest_context():
    """Packed chunks attend over their sequences' contexts side by side: together they stay
    within max_context (a long prompt's last chunk plus a new prompt once overflowed the
    runner's largest context bucket)."""
    scheduler = Scheduler(BlockManager(layout(blocks=128)), EngineLimits(
                          max_num_seqs=8, max_prefill_tokens=32, max_model_len=128))
    long, short = seq("long", 120), seq("short", 30)
    scheduler.add(long)
    long.computed = 100  # five chunks in: 20 pending, its chunk attends over 120 positions
    scheduler.add(short)
    chunks = scheduler.schedule().chunks
    assert [(c.seq.request_id, c.start, c.count) for c in chunks] == [("long", 100, 20),
                                                                      ("short", 0, 8)]
    assert sum(c.start + c.count for c in chunks) <= 128
    for c in chunks:
        c.seq.computed += c.count
    long.generated.append(7)
    chunks = scheduler.schedule().chunks
    assert [(c.seq.request_id, c.start, c.count) for c in chunks] == [("short", 8, 22)]
