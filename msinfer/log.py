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

    def __init__(self, what: str, total: int, every: float = 2.0):
        self.what, self.total, self.every = what, total, every
        self.start = self.last = time.monotonic()

    def step(self, done: int, detail: str = "") -> None:
        now = time.monotonic()
        if done == self.total or now - self.last >= self.every:
            self.last = now
            suffix = f" ({detail})" if detail else ""
            elapsed = now - self.start
            if 0 < done < self.total:  # time left, at the pace so far
                suffix = f", ~{elapsed * (self.total - done) / done:.0f}s left{suffix}"
            _logger.info("%s: %d/%d, %.1fs%s", self.what, done, self.total, elapsed, suffix)
