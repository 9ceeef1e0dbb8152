"""A stand-in for `LLM` and its engine, for fast HTTP and protocol tests of `msinfer serve`.

Same interface as msinfer's LLMEngine (add_request / abort_request / step / stats), with its
refusals (`check_request_limits`) and stop-string cut (`find_stop`), a KV pool counted in
blocks, a running-batch limit and a step delay, but no model: a request's tokens are the UTF-8
bytes of a fixed text (with multi-byte characters, so streaming meets incomplete characters),
starting at an offset its prompt chooses. With `speculative` (a SpeculativeConfig) it counts
speculative decoding's drafts as the engine's stats do (`count_draft`), one token a step
still.
"""
import math
import time
import types

from msinfer.config import ModelConfig
from msinfer.engine import EngineStats, RequestOutput  # the real engine's output types
from msinfer.engine.llm_engine import check_request_limits
from msinfer.engine.sequence import Prefix
from msinfer.engine.tokenizer import find_stop
from msinfer.engine_config import EngineConfig, EngineLimits
from msinfer.errors import MsinferError
from msinfer.planning.kv_layout import CacheLayout

TEXT = "Hello wörld, ünïcode → ok. ".encode()


def expected_ids(prompt_ids, count, text=TEXT):
    start = sum(prompt_ids) % len(text)
    return [text[(start + i) % len(text)] for i in range(count)]


class ByteTokenizer:
    """Token i < 256 is byte i; bytes that do not form a character decode to U+FFFD."""

    def encode(self, text):
        return list(text.encode())

    special_tokens = {"eos_token": "<eos>"}
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def token_bytes(self, token_id):
        return bytes([token_id]) if token_id < 256 else b""

    def token_to_id(self, token):
        return None  # no text is a token of its own (no <tool_call> or <think> tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, **template_kwargs):
        roles = [m["role"] for m in messages]
        if any(a == b for a, b in zip(roles, roles[1:])):  # as many templates' raise_exception
            raise MsinferError("chat_template: roles must alternate")
        # as Qwen3's template: enable_thinking=false closes an empty think block
        no_think = "<think></think>" if template_kwargs.get("enable_thinking") is False else ""
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + (
            "<assistant>" + no_think if add_generation_prompt else "")


def stub_engine_config(limits, vocab_size, model="/models/fake", prefix_caching=True,
                       speculative=None):
    """An EngineConfig for an engine without a checkpoint (a stub runner, the fake engine):
    `limits` and a model of `vocab_size` tokens (its other sizes are never read), and
    `speculative` a SpeculativeConfig or None."""
    model_config = ModelConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=8,
                               num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                               source=model)
    return EngineConfig(model=model, model_config=model_config, limits=limits,
                        enable_prefix_caching=prefix_caching, speculative=speculative)


class _Request:
    def __init__(self, request_id, prompt_ids, params, prompt, text=TEXT):
        self.request_id, self.prompt_ids, self.params, self.prompt = (
            request_id, prompt_ids, params, prompt)
        self.generated = []
        self.logprobs = []
        self.planned = expected_ids(prompt_ids, params.max_tokens, text)
        self.scheduled_at = None


class FakeEngine:
    def __init__(self, max_model_len=96, num_blocks=32, block_size=8, max_num_seqs=4,
                 step_delay=0.01, vocab_size=300, text=TEXT, speculative=None):
        self.text = text  # the bytes requests generate, from an offset their prompt picks
        self.max_model_len, self.num_blocks, self.block_size = max_model_len, num_blocks, block_size
        self.max_num_seqs, self.step_delay, self.vocab_size = max_num_seqs, step_delay, vocab_size
        # what the engine's refusals read of its KV cache: num_blocks besides the reserved one
        self.layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=1, block_size=block_size,
                                  num_blocks=num_blocks + 1, dtype_bytes=1)
        self.tokenizer = ByteTokenizer()
        # the settings LLMEngine carries (what the server reads of them)
        self.config = stub_engine_config(
            EngineLimits(max_model_len=max_model_len, block_size=block_size,
                         max_num_seqs=max_num_seqs), vocab_size, speculative=speculative)
        self.waiting, self.running = [], []
        self.aborted_ids = []
        self.pending_aborts = []
        self.prompt_tokens = self.generation_tokens = 0
        self.steps = self.step_count = 0
        self.resets = 0  # prefix-cache resets applied
        self.speculative = speculative
        self.spec = [0, 0, 0, [0] * (speculative.num_speculative_tokens if speculative else 0)]
        self.decisions = []

    def warmup(self):
        pass

    def compiling(self):
        return False  # no graphs

    def add_request(self, request_id, prompt_token_ids, params, prompt=None):
        ids = list(prompt_token_ids)
        self.check_request(ids, params, name=f"request {request_id!r}")
        if any(r.request_id == request_id for r in self.waiting + self.running):
            raise MsinferError(f"request id {request_id!r} is already running")
        self.waiting.append(_Request(request_id, ids, params, prompt, self.text))

    def check_request(self, ids, params, name="prompt"):
        check_request_limits(ids, params, self.vocab_size, self.max_model_len, self.layout,
                             has_tokenizer=True, name=name)

    def abort_request(self, request_id):
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.request_id == request_id:
                    queue.remove(r)
                    self.aborted_ids.append(request_id)
                    self.pending_aborts.append(r)
                    return

    def _blocks(self, tokens):
        return math.ceil(tokens / self.block_size)

    def _used(self):
        return sum(self._blocks(len(r.prompt_ids) + len(r.generated) + 1) for r in self.running)

    def reset_prefix_cache(self):
        if self.running:  # as the block manager: not while a request holds blocks
            return False
        self.resets += 1
        return True

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def step(self):
        outputs, schedule = self.begin_step()
        if not schedule.empty:
            outputs += self.run_step(schedule)
        return outputs

    # the split step of a sharded server (LLMEngine.begin_step / run_step / apply_decisions)
    def begin_step(self):
        outputs = [self._output(r, "abort") for r in self.pending_aborts]
        self.pending_aborts = []
        while (self.waiting and len(self.running) < self.max_num_seqs
               and self._used() + self._blocks(len(self.waiting[0].prompt_ids) + 1)
               <= self.num_blocks):
            r = self.waiting.pop(0)
            self.prompt_tokens += len(r.prompt_ids)
            r.scheduled_at = time.monotonic()
            self.running.append(r)
        return outputs, FakeSchedule([(r.request_id, len(r.generated)) for r in self.running])

    def run_step(self, schedule, sample=True):
        time.sleep(self.step_delay)
        self.steps += 1
        self.step_count = self.steps
        self.decisions = []
        if not sample:
            return []
        outputs = []
        for r in list(self.running):
            if r.params.max_tokens == 0:  # prompt logprobs only: scored, nothing generated
                self.running.remove(r)
                self.decisions.append([r.request_id, None, "length"])
                outputs.append(self._output(r, "length"))
                continue
            if self.speculative and r.generated:
                self.count_draft(len(r.generated))
            token = r.planned[len(r.generated)]
            r.generated.append(token)
            self.generation_tokens += 1
            n = getattr(r.params, "logprobs", None)
            if n is not None:
                r.logprobs.append({token: -0.25, **{t: -2.0 - t / 1000 for t in
                                                     range(250, 250 + n) if t != token}})
            reason = None
            text = self.tokenizer.decode(r.generated)
            if token in r.params.stop_token_ids or find_stop(text, r.params.stop) is not None:
                reason = "stop"
            elif len(r.generated) == r.params.max_tokens:
                reason = "length"
            if reason:
                self.running.remove(r)
            self.decisions.append([r.request_id, token, reason])
            outputs.append(self._output(r, reason))
        return outputs

    def count_draft(self, generated):
        """A decode step's draft of k tokens, of which `generated` % (k + 1) are accepted."""
        k = self.speculative.num_speculative_tokens
        accepted = generated % (k + 1)
        self.spec[0] += 1
        self.spec[1] += k
        self.spec[2] += accepted
        for position in range(accepted):
            self.spec[3][position] += 1

    def apply_decisions(self, decisions):
        by_id = {r.request_id: r for r in self.running}
        for request_id, token, reason in decisions:
            if request_id not in by_id:
                raise MsinferError(f"the leader decided for request {request_id!r}, which "
                                   f"this rank does not hold")
            r = by_id[request_id]
            if token is not None:
                r.generated.append(token)
                self.generation_tokens += 1
            if reason:
                self.running.remove(r)

    def _output(self, r, reason):
        text = self.tokenizer.decode(r.generated)
        cut = find_stop(text, r.params.stop)
        if cut is not None:
            text = text[:cut]
        n = getattr(r.params, "logprobs", None)
        view = Prefix if reason is None else list  # as the real engine: no copy per step
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, view(r.generated), text,
                             reason is not None, reason,
                             view(r.logprobs) if n is not None else None,
                             prompt_logprobs=self._prompt_logprobs(r),
                             scheduled_at=r.scheduled_at)

    @staticmethod
    def _prompt_logprobs(r):
        """With prompt_logprobs asked: None, then prompt token i scored -1 - i / 100 beside
        that many made-up most likely ones (ids 250...)."""
        top = getattr(r.params, "prompt_logprobs", None)
        if top is None:
            return None
        return [None] + [{t: -1.0 - i / 100, **{u: -0.5 - u / 1000 for u in
                                                range(250, 250 + top) if u != t}}
                         for i, t in enumerate(r.prompt_ids[1:], 1)]

    def stats(self):
        drafts, draft_tokens, accepted, per_position = self.spec
        return EngineStats(len(self.running), len(self.waiting), self.num_blocks, self._used(),
                           0, self.prompt_tokens, self.generation_tokens,
                           spec_num_drafts=drafts, spec_num_draft_tokens=draft_tokens,
                           spec_num_accepted_tokens=accepted,
                           spec_accepted_per_pos=tuple(per_position))


class FakeSchedule:
    def __init__(self, rows):
        self.rows = rows  # (request id, tokens generated) per running request

    @property
    def empty(self):
        return not self.rows

    def describe(self):
        return f"{len(self.rows)} requests"

    def digest(self):
        return repr(self.rows)


def fake_llm(**engine_options):
    engine = FakeEngine(**engine_options)
    return types.SimpleNamespace(engine=engine, tokenizer=engine.tokenizer, replicas=1,
                                 engine_config=engine.config,
                                 dist=types.SimpleNamespace(rank=0, world_size=1))
