"""deploy/ (the Dockerfiles, the Kubernetes manifests for the 300I Duo, the InferencePool)
against the server they deploy: every argument parses with msinfer's own CLI, the ports agree
from the container to the Service, the annotations and the InferencePool, every probed or
scraped path is a route of the app, the probes and grace period fit warm-up and the drain,
and docs/fleet.md names every endpoint and file."""
import json
import os
import re

import pytest
import yaml

from msinfer.cli.main import build_parser
from msinfer.server.app import build_app
from msinfer.server.handoff import Leader
from msinfer.server.lockstep import EngineLoop
from msinfer.server.metrics import ServerMetrics
from msinfer.server.server_config import ServerConfig

from fake_engine import fake_llm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
WARM_UP_BUDGET = 600  # seconds the startup probe must allow at least (a cold 310P warm-up)


def _manifests(name):
    with open(os.path.join(DEPLOY, "k8s", name)) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


@pytest.fixture(scope="module")
def routes():
    llm = fake_llm()
    metrics = ServerMetrics("m", llm.engine_config, llm.engine.stats())
    app = build_app(EngineLoop(llm.engine, Leader([])), llm.tokenizer,
                    ServerConfig(model_names=["m"]), llm.engine_config, metrics)
    return {route.path for route in app.routes}


def _serve_args(argv):
    """(launch's arguments or None, serve's arguments) of a container's argv (`launch ...
    -- serve ...` or `serve ...`), parsed by msinfer's own parser."""
    parser = build_parser()
    launch = None
    if argv[0] == "launch":
        launch = parser.parse_args(argv[:argv.index("--")])
        assert os.path.exists(os.path.join(ROOT, launch.strategy)), launch.strategy
        argv = argv[argv.index("--") + 1:]
    assert argv[0] == "serve"
    return launch, parser.parse_args(argv)


def _dockerfile(name):
    with open(os.path.join(DEPLOY, name)) as f:
        text = f.read().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.strip().startswith("#")]
    found = {}
    for line in lines:
        word, _, rest = line.partition(" ")
        found.setdefault(word, []).append(rest.strip())
    return found


def test_the_300i_duo_deployment_agrees_with_the_server(routes):
    kinds = _manifests("msinfer-300i-duo.yaml")
    deployment, service = kinds["Deployment"], kinds["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    launch, serve = _serve_args(container["args"])
    # the chips the pod asks for are the ranks it launches
    limits = container["resources"]["limits"]
    assert limits["huawei.com/Ascend310P"] == launch.nproc == 2
    assert launch.hardware == "atlas-300i-duo"
    assert serve.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == serve.port
    assert ports["kv-events"] == int(serve.kv_events_config["endpoint"].rsplit(":", 1)[1])
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == serve.port
    assert annotations["prometheus.io/path"] in routes
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in routes and get["port"] == "http"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 warming/draining
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= WARM_UP_BUDGET
    # preStop's wait, then the drain, then the ranks leave, inside the grace period
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= \
        int(pre_stop[1]) + serve.shutdown_timeout + 10
    # the Service reaches the pods on the server's port
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http" and port["port"] == serve.port


def test_the_inferencepool_selects_the_pods_on_the_servers_port():
    deployment = _manifests("msinfer-300i-duo.yaml")["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    _, serve = _serve_args(container["args"])
    kinds = _manifests("inferencepool.yaml")
    pool, route = kinds["InferencePool"], kinds["HTTPRoute"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"] == \
        deployment["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": serve.port}]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.ascend"])
def test_the_dockerfiles_run_the_server_they_copy(name, routes):
    found = _dockerfile(name)
    for copy in found["COPY"]:
        for source in copy.split()[:-1]:
            assert os.path.exists(os.path.join(ROOT, source)), f"{name}: COPY {source}"
    entrypoint = json.loads(found["ENTRYPOINT"][-1])
    command = json.loads(found["CMD"][-1])
    if entrypoint[0] == "bash":  # Dockerfile.ascend: CANN's environment, then msinfer
        assert "exec msinfer" in entrypoint[2]
        argv = command
    else:
        assert entrypoint[:2] == ["msinfer", "serve"]
        argv = entrypoint[1:] + command
    _, serve = _serve_args(argv)
    (exposed,) = found["EXPOSE"]
    assert int(exposed) == serve.port and serve.host == "0.0.0.0"
    for check in found.get("HEALTHCHECK", []):
        url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", check)
        assert int(url.group(1)) == serve.port and url.group(2) in routes


def test_docs_name_every_fleet_endpoint_and_deploy_file(routes):
    with open(os.path.join(ROOT, "docs", "fleet.md")) as f:
        doc = f.read()
    fleet = ["/get_load", "/get_server_info", "/get_model_info", "/flush_cache",
             "/reset_prefix_cache", "/health_generate", "/ping", "/kv_event_sources",
             "/v1/responses", "/version", "/metrics", "/health"]
    assert set(fleet) <= routes
    missing = [path for path in fleet if f"`{path}" not in doc]
    assert not missing, f"docs/fleet.md does not name {missing}"
    for dirpath, _, files in os.walk(DEPLOY):
        for name in files:
            path = os.path.relpath(os.path.join(dirpath, name), ROOT)
            assert path in doc, f"docs/fleet.md does not name {path}"
