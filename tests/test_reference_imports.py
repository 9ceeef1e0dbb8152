"""A test whose reference (torch, transformers, lm-eval, MindSpore: what a parity test
compares against) cannot be imported fails: pytest.importorskip skipped it, and a parity
module that skips passes CI proving nothing (tests/reference_imports.py, which conftest.py
loads). Run on a probe file in a pytest of its own."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

PROBE = '''
import pytest

missing = pytest.importorskip("msinfer_no_such_reference")


def test_never_runs():
    pass
'''

IN_TEST = '''
import pytest


def test_compares_against_a_missing_reference():
    pytest.importorskip("msinfer_no_such_reference")


def test_skipped_for_its_own_reason():
    pytest.skip("not on this machine")
'''


def run_probe(tmp_path, source, **env):
    (tmp_path / "test_probe.py").write_text(source)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "reference_imports", "-p", "no:cacheprovider",
         "-p", "no:randomly", "-n", "0", "-q", "-rA", str(tmp_path / "test_probe.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.path.dirname(HERE), **env))
    return done.returncode, done.stdout + done.stderr


def test_a_module_that_cannot_import_its_reference_fails(tmp_path):
    code, out = run_probe(tmp_path, PROBE)
    assert code != 0, out
    assert "msinfer_no_such_reference" in out and "1 error" in out, out


def test_a_test_that_cannot_import_its_reference_fails_and_other_skips_stay(tmp_path):
    code, out = run_probe(tmp_path, IN_TEST)
    assert code != 0, out
    assert "1 failed, 1 skipped" in out, out
    assert "MSINFER_ALLOW_MISSING_REFERENCES" in out


def test_a_developer_may_skip_them_knowingly(tmp_path):
    code, out = run_probe(tmp_path, IN_TEST, MSINFER_ALLOW_MISSING_REFERENCES="1")
    assert code == 0 and "2 skipped" in out, out
