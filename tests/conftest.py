"""Hypothesis explores new examples on developers' machines; CI (CI=true) replays a fixed
sequence so a run can be reproduced from its log."""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
