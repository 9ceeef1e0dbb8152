"""The server's periodic stats line, as vLLM's LoggingStatLogger: every `interval` seconds
in which the engine had work, the throughput and load of the replicas together, and with
speculative decoding its acceptance over the interval (engine/speculative/acceptance.py):

    serve: 31.2 prompt, 48.6 generation tokens/s; 3 running, 0 waiting; KV cache 21%;
    spec: acceptance 0.62, mean accepted 2.5/4 per draft (by position 0.91 0.70 0.52 0.35)
"""
import dataclasses
import threading
import time

from .. import log
from ..engine import EngineStats
from ..engine.speculative.acceptance import acceptance_words

STATS_INTERVAL = 10.0  # seconds, as vLLM's VLLM_LOG_STATS_INTERVAL's default


def summed(per_replica) -> EngineStats:
    """The replicas' EngineStats added up: counts summed, per-position counts position by
    position."""
    total = {}
    for field in dataclasses.fields(EngineStats):
        values = [getattr(stats, field.name) for stats in per_replica]
        if all(isinstance(v, (tuple, list)) for v in values):
            width = max(map(len, values), default=0)
            total[field.name] = tuple(sum(v[i] for v in values if i < len(v))
                                      for i in range(width))
        else:
            total[field.name] = sum(values)
    return EngineStats(**total)


class StatsLog:
    def __init__(self, speculative=None, interval=STATS_INTERVAL, clock=time.monotonic):
        """speculative: the engine's SpeculativeConfig (None: no acceptance in the line)."""
        self.k = speculative.num_speculative_tokens if speculative else None
        self.interval, self.clock = interval, clock
        self._last = None  # (time, summed EngineStats) of the last line, or of the start
        self._lock = threading.Lock()  # replicas' loops report from threads of their own

    def observe(self, per_replica):
        """Each replica's EngineStats after a pass of one of their loops."""
        now = self.clock()
        with self._lock:
            if self._last is not None and now - self._last[0] < self.interval:
                return
            last, self._last = self._last, (now, summed(per_replica))
        if last is not None:
            line = self.line(last[1], self._last[1], now - last[0])
            if line:
                log.get().info("%s", line)

    def line(self, before, after, seconds):
        """The line for the `seconds` between two summed EngineStats; None when idle."""
        prompt = after.prompt_tokens_total - before.prompt_tokens_total
        generated = after.generation_tokens_total - before.generation_tokens_total
        if not (prompt or generated or after.num_running or after.num_waiting):
            return None
        usage = after.num_blocks_used / after.num_blocks_total if after.num_blocks_total else 0
        line = (f"serve: {prompt / seconds:.1f} prompt, {generated / seconds:.1f} generation "
                f"tokens/s; {after.num_running} running, {after.num_waiting} waiting; "
                f"KV cache {usage:.0%}")
        accepted = self.k and acceptance_words(before, after, self.k)
        return f"{line}; {accepted}" if accepted else line
