"""Hypothesis explores new examples on developers' machines; CI (CI=true) replays a fixed
sequence so a run can be reproduced from its log.

Session fixtures: tiny checkpoints and transformers models that several files test against,
made (loaded) once per session for each distinct set of arguments."""
import gc
import inspect
import json
import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_finish(session):
    """MindSpore runs gc.collect() before every graph it compiles; with torch, transformers and
    MindSpore imported that walks ~500k objects (0.25 s a graph, hundreds of graphs). What the
    imports and the collection made lives all session: moved out of the collector's sight, a
    collection walks only what the tests made since."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(**make_tiny_model arguments) -> (directory, ModelConfig), the same
    directory for the same checkpoint all session (arguments left out count as their
    defaults): read it, or copy it before changing it."""
    from msinfer.tools.tiny_model import make_tiny_model

    signature = inspect.signature(make_tiny_model)
    made = {}

    def make(**spec):
        bound = signature.bind("", **spec)
        bound.apply_defaults()
        key = json.dumps({k: v for k, v in bound.arguments.items() if k != "out_dir"},
                         sort_keys=True, default=repr)
        if key not in made:
            path = str(tmp_path_factory.mktemp("tiny") / "model")
            made[key] = (path, make_tiny_model(path, **spec))
        return made[key]
    return make


@pytest.fixture(scope="session")
def small_checkpoint(tiny_checkpoint):
    """The generate CLI's, tokenizer's and planner's tests' checkpoint: 4 query heads over 2
    KV heads, a vocabulary (and tokenizer) of 512."""
    return tiny_checkpoint(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=2)[0]


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(directory) -> transformers' Qwen2ForCausalLM on it (float32, eval mode), loaded
    once per session: tests run it, never train or change it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    loaded = {}

    def load(path):
        if path not in loaded:
            loaded[path] = transformers.Qwen2ForCausalLM.from_pretrained(
                path, dtype=torch.float32).eval()
        return loaded[path]
    return load
