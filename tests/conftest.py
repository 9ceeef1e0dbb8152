"""Hypothesis explores new examples on developers' machines; CI (CI=true) replays a fixed
sequence so a run can be reproduced from its log.

Session fixtures: tiny checkpoints and transformers models that several files test against,
made (loaded) once per session for each distinct set of arguments."""
import gc
import inspect
import json
import os
import shutil
import tempfile

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# MindSpore runs gc.collect() before every graph it compiles. With torch, transformers and
# MindSpore imported that walked ~500k objects, 0.25-0.45 s a graph, hundreds of graphs. What
# lives all session (imports, collected tests, session fixtures, caches) is frozen (gc.freeze):
# out of the collector's sight, so that a collection walks only what the running tests made.
FREEZE_AFTER = 50_000  # objects made since the last freeze by one test: mostly imports on use
_frozen_in_module = []


def pytest_configure(config):
    """Compiled graphs of this session's warm-ups (every server and job it starts) go to a
    directory of its own, removed at the end, not to the user's ~/.cache/msinfer/compile."""
    if "MSINFER_COMPILE_CACHE" not in os.environ:
        os.environ["MSINFER_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="msinfer-compile-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("MSINFER_COMPILE_CACHE"),
                                                 ignore_errors=True))


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test, its module fixtures finalized: what is left is what lives
    on, frozen too. Within a module, a test that left many objects (a first LLM or
    transformers model imports MindSpore's, torch's and transformers' modules on use) freezes
    them at once; the module's fixtures may be among them, so its end unfreezes everything and
    collects it whole before freezing what lives on."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        if _frozen_in_module:
            gc.unfreeze()
            _frozen_in_module.clear()
        gc.collect()
        gc.freeze()
    elif len(gc.get_objects()) > FREEZE_AFTER:
        gc.collect()
        gc.freeze()
        _frozen_in_module.append(item.nodeid)


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


@pytest.fixture(scope="session")
def serve_model(tiny_checkpoint):
    """The checkpoint of the session's shared server (servers.TINY_SERVE_MODEL)."""
    from servers import TINY_SERVE_MODEL
    return tiny_checkpoint(**TINY_SERVE_MODEL)[0]


@pytest.fixture(scope="session")
def _tiny_servers():
    started = []
    yield started
    for server in started:
        server.kill()


@pytest.fixture
def tiny_server(serve_model, _tiny_servers, tmp_path_factory):
    """The session's one real single-process `msinfer serve` on serve_model with
    servers.SERVE_ARGS, started when first asked for and shared by every test file that needs
    a real server (one warm-up for all); started again if a test ended it (test_serve's SIGTERM
    test does)."""
    from servers import SERVE_ARGS, ServerProcess
    if not _tiny_servers or not _tiny_servers[-1].alive():
        log = str(tmp_path_factory.mktemp("log") / "serve.log")
        _tiny_servers.append(ServerProcess(
            ["serve", *SERVE_ARGS, "--model", serve_model, "--shutdown-timeout", "60"], log))
    return _tiny_servers[-1]
