"""Progress and diagnostics on stderr, tagged with the rank so interleaved logs stay readable."""
import logging
import os
import sys
import time

_logger = logging.getLogger("msinfer")


def setup(rank=None, world_size=None, level=None):
    """Route msinfer's log to stderr as `[msinfer rank r/n] message` (rank part only if n > 1)."""
    level = level or os.environ.get("MSINFER_LOG_LEVEL", "INFO")
    tag = f"msinfer rank {rank}/{world_size}" if world_size and world_size > 1 else "msinfer"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{tag} %(asctime)s] %(message)s", "%H:%M:%S"))
    _logger.handlers[:] = [handler]
    _logger.setLevel(level)
    _logger.propagate = False


def get():
    return _logger


class Progress:
    """Logs `what: i/n` at most every `every` seconds, and always the last step."""

    def __init__(self, what, total, every=2.0):
        self.what, self.total, self.every = what, total, every
        self.start = self.last = time.monotonic()

    def step(self, done, detail=""):
        now = time.monotonic()
        if done == self.total or now - self.last >= self.every:
            self.last = now
            suffix = f" ({detail})" if detail else ""
            _logger.info("%s: %d/%d, %.1fs%s", self.what, done, self.total, now - self.start,
                         suffix)
