"""Hypothesis explores new examples on developers' machines; CI (CI=true) replays a fixed
sequence so a run can be reproduced from its log.

Session fixtures: tiny checkpoints and transformers models that several files test against,
made (loaded) once per session for each distinct set of arguments."""
import gc
import inspect
import json
import os
import shutil
import sys
import tempfile

import pytest
from hypothesis import settings

# Test modules import one another's helpers and fixtures across layer folders (a parity
# module's checks, the fake-engine server of test_serve_protocol): every folder importable
# by a module's plain name, whichever folder pytest collects first.
LAYERS = ("models", "engine", "planning", "parallel", "server", "cli", "tools")
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[1:1] = [os.path.join(TESTS, layer) for layer in LAYERS]

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# a test or module that cannot import its reference (torch, transformers, lm-eval, MindSpore)
# fails rather than skips (reference_imports.py)
from reference_imports import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401,I001


# MindSpore runs gc.collect() before every graph it compiles. With torch, transformers and
# MindSpore imported that walked ~500k objects, 0.25-0.45 s a graph, hundreds of graphs. What
# lives all session (imports, collected tests, session fixtures, caches) is frozen (gc.freeze):
# out of the collector's sight, so that a collection walks only what the running tests made.
FREEZE_AFTER = 50_000  # objects made since the last freeze by one test: mostly imports on use
_frozen_in_module = []


# A directory of the session, shared by its workers (made by the controller, which they
# inherit it from): files a test makes once for every worker (test_quantized's msModelSlim
# checkpoints), under a lock of their own.
SHARED_DIR = "MSINFER_TEST_SHARED"


def pytest_configure(config):
    """Compiled graphs of this session's warm-ups (every server and job it starts) and its
    C++ kernels go to directories of their own, removed at the end, not to the user's
    ~/.cache/msinfer."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ[UNITS_FILE] = os.path.join(tempfile.mkdtemp(prefix="msinfer-xdist-"),
                                               "units.json")
        config.add_cleanup(lambda: shutil.rmtree(os.path.dirname(os.environ.pop(UNITS_FILE)),
                                                 ignore_errors=True))
    if hasattr(config, "workerinput"):
        # Two workers (and their jobs' ranks) share two cores: kernels of one thread each.
        # MindSpore's and torch's pools wait for every thread of a kernel, so a pool of two
        # on a busy core stalls while its second thread waits to be scheduled.
        os.environ.setdefault("MSINFER_CPU_THREADS", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "MSINFER_KERNEL_CACHE" not in os.environ:  # C++ kernels built once per session
        os.environ["MSINFER_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="msinfer-kernels-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("MSINFER_KERNEL_CACHE"),
                                                 ignore_errors=True))
    if SHARED_DIR not in os.environ:  # what the workers make once for all of them
        os.environ[SHARED_DIR] = tempfile.mkdtemp(prefix="msinfer-tests-shared-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(SHARED_DIR), ignore_errors=True))
    if "MSINFER_COMPILE_CACHE" not in os.environ:
        os.environ["MSINFER_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="msinfer-compile-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("MSINFER_COMPILE_CACHE"),
                                                 ignore_errors=True))


# Under pytest-xdist (setup.cfg's addopts: two workers on two cores) a test is a unit of work of
# its own, given to whichever worker is free, except:
# - the jobs of four ranks (`multirank`), one unit, given out first: one after the other on one
#   worker (two at once would put 8 ranks on 2 cores, and past the sharded servers' 5 s stall
#   bound);
# - the tests of the session's one-process server (`tiny_server`), one unit, given out second:
#   one warm-up for all of them;
# - the tests of a module that share a module fixture (an engine, a job), one unit: the fixture
#   made once, the tests in their order. A job of two ranks (`multirank(ranks=2)`) is such a
#   test, not one of the four-rank unit: it runs beside that unit (a job of 4 ranks, and one
#   of 2 ranks on the other worker, at a lower priority: pytest_runtest_protocol),
#   with its module's fixtures (checkpoints, quantized directories) made once on its worker;
#   the units that hold one are given out after the first two, being long.
# A third worker takes the units that mostly wait (a fake engine's server, a socket, a
# subprocess: marked `waits`) and the server unit (whose tests wait on the server's answers),
# beside the two that compute: run on those, they left the cores 12-16% idle. When none are
# left it takes units that start no job, at the lowest priority: it computes in what the
# others leave idle (a job's start, a stall bound) and yields the cores to them otherwise.
# Workers collect the tests, the controller schedules them (units_scheduler.py): the first
# worker writes each test's unit to a file the controller reads.
UNITS_FILE = "MSINFER_TEST_UNITS"
FIRST_UNITS = ("multirank", "server")


def unit_of(item):
    multirank = item.get_closest_marker("multirank")
    if multirank and multirank.kwargs.get("ranks", 4) > 2:
        return "multirank"
    if item.get_closest_marker("server") or "tiny_server" in item.fixturenames:
        return "server"
    fixtures = item._fixtureinfo.name2fixturedefs.values()
    if any(d.scope in ("module", "class") for defs in fixtures for d in defs):
        return item.nodeid.split("::", 1)[0]
    return item.nodeid


def pytest_collection_modifyitems(config, items):
    path = os.environ.get(UNITS_FILE)
    if path and getattr(config, "workerinput", {}).get("workerid") == "gw0":
        units = {item.nodeid: unit_of(item) for item in items}
        pairs = [units[item.nodeid] for item in items if item.get_closest_marker("multirank")
                 and units[item.nodeid] != "multirank"]
        first = list(FIRST_UNITS) + [u for u in dict.fromkeys(pairs) if u not in FIRST_UNITS]
        # units whose every test is marked `waits`, and the server unit
        busy = {units[item.nodeid] for item in items if not item.get_closest_marker("waits")}
        waiting = sorted(set(units.values()) - (busy - {"server"}))
        with open(path + ".tmp", "w") as f:
            json.dump({"units": units, "first": first, "waiting": waiting}, f)
        os.replace(path + ".tmp", path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from units_scheduler import UnitScheduling

    def read_units():
        with open(os.environ[UNITS_FILE]) as f:
            found = json.load(f)
        return found["units"], found["first"], found["waiting"]
    return UnitScheduling(config, read_units)


# The four-rank unit is the suite's longest unit, and what ran beside it (jobs of two ranks
# among them) took the cores from its ranks. The other computing worker runs its units at a
# lower priority (never raised again; its jobs and servers inherit it): the four-rank jobs take
# the cores whenever they compute, that worker what they leave (a job's start, a timeout). The
# waiting worker keeps its priority for its waiting units (they need little CPU, and bound how
# long a server or a link takes to answer), and takes the lowest for what it computes after.
BESIDE_MULTIRANK_NICE = 5
IN_IDLE_TIME_NICE = 19
_niced = []


def is_waiting_worker(config):
    from units_scheduler import waiting_worker
    workerinput = getattr(config, "workerinput", {})
    return workerinput.get("workerid") == waiting_worker(workerinput.get("workercount", 0))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if not hasattr(item.config, "workerinput") or _niced:
        return
    if not is_waiting_worker(item.config):
        if unit_of(item) != "multirank":
            os.nice(BESIDE_MULTIRANK_NICE)
            _niced.append(item.nodeid)
    elif unit_of(item) != "server" and not item.get_closest_marker("waits"):
        os.nice(IN_IDLE_TIME_NICE)
        _niced.append(item.nodeid)


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
def shared_dir():
    """The session's directory every worker shares (SHARED_DIR): what one worker makes there
    the others find, each file under a lock of its own."""
    return os.environ[SHARED_DIR]


@pytest.fixture(scope="session")
def qwen3_serve_model(tiny_checkpoint):
    """A Qwen3 checkpoint of the shared server's size (servers.dp2_tp2_job's): Qwen3's chat
    template, its think tags one token each (tiny_model)."""
    from servers import TINY_SERVE_MODEL
    return tiny_checkpoint(family="qwen3", **TINY_SERVE_MODEL)[0]


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
    a real server (one warm-up for all: under xdist their tests are one unit of work; the
    multi-rank worker starts its own for test_serve's comparisons); started again if a test
    ended it (test_serve's SIGTERM test does)."""
    from servers import SERVE_ARGS, ServerProcess, kv_events_args
    if not _tiny_servers or not _tiny_servers[-1].alive():
        log = str(tmp_path_factory.mktemp("log") / "serve.log")
        # it publishes KV-cache events too (test_fleet_server.py subscribes)
        _tiny_servers.append(ServerProcess(
            ["serve", *SERVE_ARGS, "--model", serve_model, "--shutdown-timeout", "60",
             *kv_events_args()], log))
    return _tiny_servers[-1]
