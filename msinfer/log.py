"""Progress and diagnostics on stderr, tagged with the rank so interleaved logs stay readable.

Progress is a logged line now and then (`Progress`), never a carriage-return redraw: the same
output reads well on a terminal, through a pipe and in a CI log.
"""
from __future__ import annotations

import logging
import os
import sys
import time

from .errors import MsinferError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_logger = logging.getLogger("msinfer")


def setup(rank: int | None = None, world_size: int | None = None,
          level: str | None = None) -> None:
    """Route msinfer's log to stderr as `[msinfer rank r/n] message` (rank part only if n > 1).
    The level: `level`, else MSINFER_LOG_LEVEL, else INFO."""
    level = (level or os.environ.get("MSINFER_LOG_LEVEL") or "INFO").upper()
    if level not in LEVELS:
        raise MsinferError(f"MSINFER_LOG_LEVEL={level!r}: use one of {', '.join(LEVELS)}")
    tag = f"msinfer rank {rank}/{world_size}" if world_size and world_size > 1 else "msinfer"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{tag} %(asctime)s] %(message)s", "%H:%M:%S"))
    _logger.handlers[:] = [handler]
    _logger.setLevel(level)
    _logger.propagate = False


def get() -> logging.Logger:
    return _logger


class Progress:
    """Logs `what: i/n` at most every `every` seconds, and always the last step."""

    def __init__(self, what: str, total: int, every: float = 2.0, on_step=None):
        """on_step(text): hears every step's line, logged or not (a server's /health)."""
        self.what, self.total, self.every, self.on_step = what, total, every, on_step
        self.start = self.last = time.monotonic()

    def step(self, done: int, detail: str = "") -> None:
        now = time.monotonic()
        elapsed = now - self.start
        left = (f", ~{elapsed * (self.total - done) / done:.0f}s left"
                if 0 < done < self.total else "")  # at the pace so far
        if self.on_step:
            self.on_step(f"{self.what}: {done}/{self.total}, {elapsed:.1f}s{left}")
        if done == self.total or now - self.last >= self.every:
            self.last = now
            suffix = f" ({detail})" if detail else ""
            _logger.info("%s: %d/%d, %.1fs%s%s", self.what, done, self.total, elapsed, left,
                         suffix)
