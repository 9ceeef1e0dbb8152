"""The scheduler and the block manager under random traffic, without a model.

A hypothesis state machine adds requests, steps and aborts in random order against a small KV
cache (so that preemption is frequent). A step does to the sequences what LLMEngine.step does:
every chunk and decode is computed, each sequence whose pending tokens are all computed gets a
token, and sequences finish at random or at their length bound (LLMEngine._postprocess, Sequence.stop_reason). After every
operation the block accounting and the queues must be consistent, and every schedule must keep
the scheduler's promises: the prefill budget, the sequence slots, the context bound, each
sequence at most once, victims taken latest admitted first and none of them scheduled in the
same step, and progress whenever there is work. At the end the queue must drain: every
request finishes.

With prefix caching (drawn on or off; prompts share drawn prefixes): the test keeps what each
block holds, position by position, as the steps write it, and checks that every computed
position a running sequence reads holds that sequence's token (a block taken from the cache
holds exactly the prompt's prefix, and nobody overwrote it), that a step writes only into
blocks its sequence alone holds and that are not named, and that free + named-free + held
blocks are exactly the pool, with each held block's reference count the number of holders.
"""
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from msinfer.engine.block_manager import BlockManager
from msinfer.engine.sampling import SamplingParams
from msinfer.engine.scheduler import Schedule, Scheduler
from msinfer.engine.sequence import Sequence, Status
from msinfer.engine_config import EngineLimits
from msinfer.planning.kv_layout import TRASH_BLOCK, CacheLayout

DRAIN_STEPS = 10_000  # far above what the largest drawn workload needs


class EngineMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(3, 10),
                max_num_seqs=st.integers(1, 6), max_prefill_tokens=st.integers(1, 16),
                extra_len=st.integers(-8, 8), finish_per_mille=st.integers(0, 100),
                prefix_caching=st.booleans(), rng=st.randoms(use_true_random=True),
                data=st.data())
    def setup(self, block_size, num_blocks, max_num_seqs, max_prefill_tokens, extra_len,
              finish_per_mille, prefix_caching, rng, data):
        self.layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=1, block_size=block_size,
                                  num_blocks=num_blocks, dtype_bytes=2)
        usable = self.layout.usable_tokens
        # the engine's max_model_len, also the scheduler's max_context: below or above the
        # pool's size; at least 2 tokens (a one-token prompt and one generated token)
        self.max_model_len = max(2, usable + extra_len)
        # what LLMEngine.check_request lets in: prompt + max_tokens within both bounds
        self.max_total = min(self.max_model_len, usable)
        self.blocks = BlockManager(self.layout, prefix_caching=prefix_caching)
        self.content = {}  # block -> {slot: token written there}
        self.scheduler = Scheduler(self.blocks, EngineLimits(
            max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
            max_model_len=self.max_model_len))
        self.finish_chance = finish_per_mille / 1000
        self.rng = rng
        self.unfinished = []  # in arrival order
        self.arrivals = 0
        for _ in range(data.draw(st.integers(1, 6), label="initial requests")):
            self._add(data)

    # ---- operations ----

    @rule(data=st.data())
    def add(self, data):
        """One to four requests arrive (more arrive than are aborted: the pool fills up)."""
        for _ in range(data.draw(st.integers(1, 4), label="requests")):
            self._add(data)

    def _add(self, data):
        # often short prompts and generations as long as allowed: then several sequences are
        # admitted and outgrow the pool together, and preempt
        longest = self.max_total - 1
        prompt_len = data.draw(st.integers(1, max(1, longest // 4)) | st.integers(1, longest),
                               label="prompt_len")
        room = self.max_total - prompt_len
        max_tokens = data.draw(st.just(room) | st.integers(1, room), label="max_tokens")
        self.arrivals += 1
        # one of three "system prompts" (shared prefixes), then a drawn tail
        system = data.draw(st.integers(0, 2), label="prefix")
        tail = data.draw(st.lists(st.integers(1, 3), max_size=min(2, prompt_len)), label="tail")
        prompt = ([10 + system] * prompt_len + tail)[:prompt_len - len(tail)] + tail
        seq = Sequence(f"r{self.arrivals}", prompt[:prompt_len],
                       SamplingParams(max_tokens=max_tokens))
        self.unfinished.append(seq)
        self.scheduler.add(seq)

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):  # several at once: sequences grow and collide
            self._step()

    @rule(data=st.data())
    def abort(self, data):
        if not self.unfinished:
            return
        rid = data.draw(st.sampled_from([s.request_id for s in self.unfinished]), label="abort")
        self._finish(next(s for s in self.unfinished if s.request_id == rid), "abort")

    # ---- the engine's step without a model (LLMEngine.step and _postprocess) ----

    def _step(self) -> Schedule:
        had_work = self.scheduler.has_work()
        running_before = list(self.scheduler.running)
        schedule = self.scheduler.schedule()
        self._check_schedule(schedule, running_before)
        assert not (had_work and schedule.empty), "work waits but the step does nothing"
        if schedule.preempted:
            event("preemption")
        if schedule.empty:
            return schedule
        if any(s.computed for s in self.scheduler.running if s.cached_tokens):
            event("prefix cache hit")
        writes = [(c.seq, c.start, c.count) for c in schedule.chunks]
        writes += [(s, s.length - 1, 1) for s in schedule.decodes]
        for seq, start, count in writes:  # what the runner writes: K/V of these positions
            for pos in range(start, start + count):
                block = seq.block_table[pos // self.layout.block_size]
                assert self.blocks.refs[block] == 1, "a write into a shared block"
                assert block not in self.blocks.name_of, "a write into a named block"
                self.content.setdefault(block, {})[pos % self.layout.block_size] = \
                    seq.tokens[pos]
        for chunk in schedule.chunks:
            chunk.seq.computed += chunk.count
            self.blocks.computed(chunk.seq)
        sampled = [c.seq for c in schedule.chunks if c.completes]
        for seq in schedule.decodes:
            seq.computed += 1
            self.blocks.computed(seq)
        sampled += schedule.decodes
        for seq in sampled:
            seq.generated.append(7)
            if len(seq.generated) >= seq.params.max_tokens or seq.length >= self.max_model_len:
                self._finish(seq, "length")
            elif self.rng.random() < self.finish_chance:
                self._finish(seq, "stop")
        self._check_blocks()
        return schedule

    def _finish(self, seq, reason):
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.unfinished.remove(seq)

    # ---- what must hold ----

    def _check_schedule(self, schedule, running_before):
        sched = self.scheduler
        chunk_seqs = [c.seq for c in schedule.chunks]
        named = schedule.decodes + chunk_seqs
        assert len({id(s) for s in named}) == len(named), "a sequence scheduled twice"
        assert not {id(s) for s in schedule.preempted} & {id(s) for s in named}, \
            "a sequence preempted and scheduled in the same step"
        # victims go latest admitted first: the running list's tail, from its end
        victims = running_before[len(running_before) - len(schedule.preempted):][::-1]
        assert len(victims) == len(schedule.preempted)
        assert all(a is b for a, b in zip(schedule.preempted, victims)), "not latest admitted"
        for s in schedule.preempted:
            assert s.status is Status.WAITING and not s.block_table and s.computed == 0
            assert any(s is w for w in sched.waiting)
        assert sum(c.count for c in schedule.chunks) <= sched.max_prefill_tokens
        assert sum(c.start + c.count for c in schedule.chunks) <= sched.max_context
        assert len(sched.running) <= sched.max_num_seqs
        for s in named:
            assert s.status is Status.RUNNING and any(s is r for r in sched.running)
        for c in schedule.chunks:
            assert c.count >= 1 and c.start == c.seq.computed
            assert c.start + c.count <= c.seq.length
            assert len(c.seq.block_table) >= self.layout.blocks_for(c.start + c.count)
        for s in schedule.decodes:
            assert s.pending == 1
            assert len(s.block_table) >= self.layout.blocks_for(s.length)

    @invariant()
    def blocks_and_queues_are_consistent(self):
        self._check_blocks()

    def _check_blocks(self):
        sched, blocks = self.scheduler, self.blocks
        held = [b for s in sched.running for b in s.block_table]
        owned = set(held)
        free = list(blocks.free) + list(blocks.free_named)
        assert len(free) + len(owned) == blocks.num_usable == self.layout.num_blocks - 1
        assert not owned & set(free), "a block both held and free"
        assert len(set(free)) == len(free), "a block free twice"
        for b in range(self.layout.num_blocks):
            assert blocks.refs[b] == held.count(b), "a reference count off"
        assert all(b in blocks.name_of for b in blocks.free_named)
        assert all(blocks.named[name] == b for b, name in blocks.name_of.items())
        shared = {b for b in owned if blocks.refs[b] > 1}
        assert shared <= set(blocks.name_of), "a block shared but not from the cache"
        for s in sched.running:  # what a sequence reads is its own tokens
            for pos in range(s.computed):
                block = s.block_table[pos // self.layout.block_size]
                assert self.content[block][pos % self.layout.block_size] == s.tokens[pos], \
                    f"{s.request_id} reads a wrong K/V at position {pos}"
        assert TRASH_BLOCK not in owned and TRASH_BLOCK not in free
        assert all(0 <= b < self.layout.num_blocks for b in held + free)
        assert len(sched.running) <= sched.max_num_seqs
        for s in sched.running:
            assert s.status is Status.RUNNING
            assert len(s.block_table) >= self.layout.blocks_for(s.computed)
            assert s.computed < s.length  # a running sequence always has a token pending
        for s in sched.waiting:
            assert s.status is Status.WAITING and not s.block_table and s.computed == 0
        queued = list(sched.running) + list(sched.waiting)
        assert sorted(id(s) for s in queued) == sorted(id(s) for s in self.unfinished)

    def teardown(self):
        """Everything queued finishes: no request starves, no step livelocks."""
        if not hasattr(self, "scheduler"):
            return
        for _ in range(DRAIN_STEPS):
            if not self.scheduler.has_work():
                break
            self._step()
        assert not self.scheduler.has_work() and not self.unfinished
        assert self.blocks.num_used == 0


TestEngineProperties = EngineMachine.TestCase
TestEngineProperties.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
