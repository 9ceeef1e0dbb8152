"""`python -m msinfer ...` is `msinfer ...` (also what the launcher runs on every rank)."""
import sys

from msinfer.cli.main import main

sys.exit(main())
