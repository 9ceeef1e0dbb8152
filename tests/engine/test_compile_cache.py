"""The compile cache (engine/compile_cache.py): a restart of the same configuration loads
warm-up's graphs and generates the same tokens; another configuration gets its own entry; a
corrupted graph file or an entry that a dead warm-up left are rebuilt with a warning.

Each warm-up that uses the cache runs in a process of its own, as a server's does: MindSpore
numbers cached graphs per process."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = dict(max_len=64, max_num_seqs=2, max_prefill_tokens=16)  # few graphs: a short warm-up
WARM = """
import json, sys, time
from msinfer import LLM
from msinfer.engine.sampling import SamplingParams
llm = LLM(sys.argv[1], compile_cache=sys.argv[2], **json.loads(sys.argv[3]))
start = time.monotonic()
graphs = llm.warmup()
seconds = time.monotonic() - start
out = llm.generate(["one two three", "four"], SamplingParams(max_tokens=6, temperature=0))
print(json.dumps({"graphs": graphs, "seconds": seconds, "key": llm.compile_cache.key,
                  "tokens": [o.token_ids for o in out]}))
"""


def warm(model, cache, **engine):
    script = cache / "warm.py"  # a file: MindSpore's cache reads the entry script
    script.write_text(WARM)
    done = subprocess.run(
        [sys.executable, str(script), model, str(cache), json.dumps(dict(ENGINE, **engine))],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT, GLOG_v="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def graph_files(entry):
    return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_mtime_ns
            for d, _, names in os.walk(entry) for n in names if n.endswith(".mindir")}


@pytest.fixture(scope="module")
def model(small_checkpoint):
    return small_checkpoint


@pytest.fixture
def said(caplog, monkeypatch):
    """What msinfer logs in this test (its logger stops propagating once a rank sets it up:
    log.setup)."""
    from msinfer import log
    monkeypatch.setattr(log.get(), "propagate", True)
    return caplog


def test_a_restart_loads_every_graph_and_a_corrupt_one_is_compiled_again(model, tmp_path):
    cold, said = warm(model, tmp_path)
    assert "compile cache: filling" in said
    entry = tmp_path / cold["key"]
    files = graph_files(entry)
    assert len(files) == cold["graphs"] > 0
    assert json.loads((entry / "manifest.json").read_text())["graphs"] == len(files)

    warm_again, said = warm(model, tmp_path)
    assert "compile cache: loading from" in said
    assert f"loading graphs: {len(files)}/{len(files)}" in said
    assert warm_again["tokens"] == cold["tokens"] and warm_again["key"] == cold["key"]
    assert graph_files(entry) == files  # every graph read, none written again

    damaged = sorted(files)[1]
    with open(damaged, "r+b") as f:
        f.truncate(100)
    rebuilt, said = warm(model, tmp_path)
    assert rebuilt["tokens"] == cold["tokens"]
    assert f"1 of {len(files)} graphs were unreadable or stale and were compiled again" in said
    assert os.path.getsize(damaged) > 100


def test_an_entry_a_dead_warmup_left_is_emptied_and_a_process_uses_the_cache_once(
        tmp_path, monkeypatch, said):
    from msinfer.engine import compile_cache

    from mindspore.graph import api

    monkeypatch.setattr(compile_cache, "_used_in_process", False)
    # the entry script MindSpore would read: a file, whatever started this process (an
    # xdist worker's is `-c`, which turns the cache off)
    monkeypatch.setattr(api, "entry_script_path", __file__)
    cache = compile_cache.CompileCache(str(tmp_path), {"model": "x"})
    left = tmp_path / cache.key / "rank_0" / "graph_cache" / "compile_cache_0.mindir"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"half a graph")  # and no manifest: the warm-up died
    with cache.session() as state:
        assert state == "fill" and not left.exists()
    assert "an entry without its manifest (a warm-up that did not finish): rebuilding" in \
        said.text
    assert (tmp_path / cache.key / "manifest.json").is_file()
    with cache.session() as state:  # MindSpore would number this process's graphs on
        assert state is None


def cache_key(model, root, **engine):
    from msinfer import LLM
    return LLM(model, compile_cache=str(root), **dict(ENGINE, **engine)).compile_cache.key


@pytest.fixture(scope="module")
def base_key(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    key = cache_key(model, root)
    assert cache_key(model, root) == key  # the same configuration: the same entry
    return root, key


@pytest.mark.parametrize("change", [dict(max_len=32), dict(dtype="float16"),
                                    dict(parallel_mode="semi_auto"), dict(block_size=8),
                                    dict(graph_shapes="static")])
def test_the_key_changes_with_what_changes_a_graph(model, base_key, change):
    root, key = base_key
    assert cache_key(model, root, **change) != key


def test_another_checkpoint_of_the_same_shape_gets_its_own_entry(tiny_checkpoint, base_key):
    from msinfer import LLM

    root, key = base_key
    other = tiny_checkpoint(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)[0]
    assert cache_key(other, root) != key
    assert LLM(other, compile_cache=False, **ENGINE).compile_cache is None


def test_lazy_warmup_compiles_nothing_at_start_and_says_so(small_checkpoint, monkeypatch,
                                                           caplog):
    from msinfer import LLM, log
    from msinfer.server.api_server import _warmup
    from msinfer.server.server_config import ServerConfig

    llm = LLM(small_checkpoint, compile_cache=False, **ENGINE)
    monkeypatch.setattr(log.get(), "propagate", True)  # after LLM's log.setup()
    _warmup(llm, ServerConfig(model_names=["x"], lazy_warmup=True))
    assert llm.compilations == 0
    calls = len(llm.engine.runner.shapes())
    assert (f"lazy warm-up: ready at once; each graph compiles on its first use (warm-up would "
            f"run {calls} calls)") in caplog.text


def test_the_key_reads_the_weights_not_their_file_times(model, tmp_path, tiny_checkpoint):
    """A copy of the checkpoint whose files have other times (cp, rsync without -t) keys the
    same entry; other weights of the same size and time do not."""
    import shutil

    from msinfer.engine.compile_cache import weight_files
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    for name in os.listdir(copy):
        os.utime(copy / name, ns=(1, 10 ** 18))  # other times, same bytes
    assert weight_files(str(copy)) == weight_files(model)
    other = tiny_checkpoint(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)[0]
    for name in os.listdir(other):  # the other weights, under this copy's names and times
        if name.endswith(".safetensors"):
            shutil.copyfile(os.path.join(other, name), copy / name)
            os.utime(copy / name, ns=(1, 10 ** 18))
    assert weight_files(str(copy)) != weight_files(model)


def test_the_key_covers_the_cann_versions(tmp_path, monkeypatch):
    """Graphs compiled by one CANN (its compiler, runtime, driver) are not loaded under
    another: the version files of the toolkit that $ASCEND_HOME_PATH names enter the key."""
    from msinfer.engine.compile_cache import cache_key
    (tmp_path / "compiler").mkdir()
    version = tmp_path / "compiler" / "version.info"
    version.write_text("Version=8.0.RC2\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    first = cache_key({"model": "m"})
    assert cache_key({"model": "m"}) == first
    version.write_text("Version=8.0.RC3\n")
    assert cache_key({"model": "m"}) != first
