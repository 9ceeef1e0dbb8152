"""The package keeps its layers: no module imports a higher layer, the diagram in
docs/architecture.md is the one the code draws, and the planner runs without the heavy parts."""
import pathlib
import subprocess
import sys

from msinfer.tools import architecture

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_import_points_down_a_layer():
    assert architecture.violations() == []


def test_an_upward_import_is_named():
    graph = architecture.import_graph()
    graph["msinfer.planning.memory"] = graph["msinfer.planning.memory"] | {
        "msinfer.engine.scheduler"}
    assert architecture.violations(graph) == [
        "msinfer.planning.memory (planning) imports msinfer.engine.scheduler (engine), "
        "a higher layer"]


def test_lazy_and_relative_imports_are_read():
    graph = architecture.import_graph()
    # api.LLM imports the model runner inside __init__ (MindSpore is slow to import).
    assert "msinfer.engine.model_runner" in graph["msinfer.api"]
    # `from ..parallel import ranktable` is the module, not the package.
    assert "msinfer.parallel.ranktable" in graph["msinfer.cli.ranktable"]


def test_the_diagram_in_the_docs_is_the_one_the_code_draws():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert architecture.MARKER in text, "run: python -m msinfer.tools.architecture --write " \
                                        "docs/architecture.md"
    assert text[text.index(architecture.MARKER):] == architecture.generated_section(), \
        "docs/architecture.md is stale: python -m msinfer.tools.architecture --write " \
        "docs/architecture.md"


HIDE_HEAVY = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mindspore", "tokenizers", "jinja2", "safetensors", "torch"):
            raise ImportError(f"{name} is not installed (test)")
sys.meta_path.insert(0, Missing())
from msinfer.cli.main import main
code = main(["plan", "--model", "qwen2-72b", "--strategy", "strategies/qwen2_tp4.yaml",
             "--hardware", "atlas-300i-duo", "--max-len", "8192"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("mindspore", "tokenizers", "jinja2"))
print("EXIT", code, "HEAVY", heavy)
"""


def test_the_planner_runs_without_mindspore_tokenizers_or_jinja2():
    done = subprocess.run([sys.executable, "-c", HIDE_HEAVY], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "FITS" in done.stdout
    assert done.stdout.strip().endswith("EXIT 0 HEAVY []")


def test_msinfer_version():
    done = subprocess.run([sys.executable, "-m", "msinfer", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    import msinfer
    assert done.stdout.strip() == f"msinfer {msinfer.__version__}"
