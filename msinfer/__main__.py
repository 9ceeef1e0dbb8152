"""`python -m msinfer ...` is `msinfer ...` (also what the launcher runs on every rank)."""
from msinfer.cli.main import run

run()
