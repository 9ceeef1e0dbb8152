"""Imported by Python at the start of every process that has this folder on PYTHONPATH
(tests/faults.py: a launched job's ranks, for the tests that plant a fault in them)."""
import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _TESTS)
try:
    from faults import plant_from_environment
finally:
    sys.path.remove(_TESTS)  # the rank imports nothing else of tests/

plant_from_environment()
