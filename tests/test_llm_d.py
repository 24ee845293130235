"""deploy/llm-d, proven offline (docs/llm-d.md): the endpoint picker's configuration
validates against its vendored schema (and a wrong one does not), and every address
one object gives another is that object's: the pool selects the flagstop Pods on the
router's port and names the picker's Service; the picker subscribes to the port the
scheduler publishes KV events on, replays from its replay port, asks a Service of
those Pods to render prompts for the model they serve, and takes only its own flags."""

import copy
import json
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from flagstop.scheduler_svc.kv_event_publisher import KVEventsConfig
from tests.helpers.k8s import SCHEMAS, named, render
from tools.stack import ROOT

pytestmark = pytest.mark.processes  # kubectl renders

PICKER_SCHEMA = json.loads((SCHEMAS / "endpointpickerconfig.v1alpha1.json").read_text())
PICKER_FLAGS = set(json.loads((SCHEMAS / "endpoint-picker-flags.json").read_text())["flags"])


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(ROOT / "deploy" / "llm-d")


def picker_config(objects) -> dict:
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap"
                    and o["metadata"]["name"].startswith("flagstop-epp")]  # fmt: skip
    return yaml.safe_load(config_map["data"]["flagstop.yaml"])


def plugin(config: dict, kind: str) -> dict:
    return next(p for p in config["plugins"] if p["type"] == kind)


def pod(objects) -> dict:
    return named(objects, "Deployment", "flagstop-replica")["spec"]["template"]


def container(objects, name: str) -> dict:
    return next(c for c in pod(objects)["spec"]["containers"] if c["name"] == name)


def env(container_spec: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_spec["env"]}


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_the_picker_config_validates_and_a_wrong_one_does_not(objects):
    config = picker_config(objects)
    jsonschema.validate(config, PICKER_SCHEMA)
    wrong = [
        ("plugins", 0, "type", "prefix-scorer"),
        ("schedulingProfiles", 0, "plugins", 0, "weigth", 1),
        ("plugins", 4, "parameters", "kvEventsConfig", "socketport", 5557),
    ]
    for *path, value in wrong:
        broken = copy.deepcopy(config)
        target = broken
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, PICKER_SCHEMA)


def test_every_reference_in_the_picker_config_names_a_plugin(objects):
    config = picker_config(objects)
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    for source in config["dataLayer"]["sources"]:
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    assert set(refs) <= declared
    scorer = plugin(config, "prefix-cache-scorer")["parameters"]
    assert scorer["prefixMatchInfoProducerName"] in declared
    for kind in ("queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer",
                 "precise-prefix-cache-producer", "token-producer"):  # fmt: skip
        assert kind in declared, kind


def test_the_picker_subscribes_where_each_scheduler_publishes(objects):
    events = plugin(picker_config(objects), "precise-prefix-cache-producer")["parameters"]
    discovery = events["kvEventsConfig"]["podDiscoveryConfig"]
    scheduler = container(objects, "scheduler")
    published = KVEventsConfig.model_validate_json(
        env(scheduler)["FLAGSTOP_SCHEDULER_KV_EVENTS_CONFIG"])  # fmt: skip
    assert published.endpoint == f"tcp://*:{discovery['socketPort']}"
    assert published.replay_endpoint == f"tcp://*:{discovery['replaySocketPort']}"
    ports = {p["containerPort"] for p in scheduler["ports"]}
    assert {discovery["socketPort"], discovery["replaySocketPort"]} <= ports
    # The topic names the Pod by its IP, which the kubelet gives the scheduler.
    assert published.topic == "kv@${POD_IP}@${MODEL}"
    assert env(scheduler)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    key, value = discovery["podLabelSelector"].split("=")
    assert pod(objects)["metadata"]["labels"][key] == value
    assert events["kvEventsConfig"]["topicFilter"] == "kv@"


def test_the_picker_renders_prompts_at_a_replica_for_the_served_model(objects):
    tokens = plugin(picker_config(objects), "token-producer")["parameters"]
    router = env(container(objects, "router"))
    assert tokens["modelName"] == router["FLAGSTOP_ROUTER_MODEL"].rsplit("/", 1)[1]
    url = urlparse(tokens["vllm"]["url"])
    service = named(objects, "Service", url.hostname)
    assert selects(service["spec"]["selector"], pod(objects)["metadata"]["labels"])
    [port] = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    assert str(port["targetPort"]) == router["FLAGSTOP_ROUTER_HTTP_PORT"]


def test_the_pool_selects_the_replicas_and_names_the_picker(objects):
    pool = named(objects, "InferencePool", "flagstop")["spec"]
    labels = pod(objects)["metadata"]["labels"]
    assert selects(pool["selector"]["matchLabels"], labels)
    assert labels["llm-d.ai/engine-type"] == "vllm"  # the picker reads vLLM's names
    router = env(container(objects, "router"))
    assert [p["number"] for p in pool["targetPorts"]] == [int(router["FLAGSTOP_ROUTER_HTTP_PORT"])]
    picker = named(objects, "Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in {p["port"] for p in
                                                           picker["spec"]["ports"]}  # fmt: skip
    route = named(objects, "HTTPRoute", "flagstop")["spec"]
    assert route["rules"][0]["backendRefs"][0]["name"] == "flagstop"
    # Ready only when every container is: the scheduler's readiness is its executor's.
    assert all("readinessProbe" in c for c in pod(objects)["spec"]["containers"])


def test_the_picker_takes_its_flags_and_mounts_its_config(objects):
    deployment = named(objects, "Deployment", "flagstop-epp")["spec"]["template"]["spec"]
    [epp] = deployment["containers"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in epp["args"])
    assert set(flags) <= PICKER_FLAGS
    assert flags["pool-name"] == "flagstop" and flags["pool-group"] == "inference.networking.k8s.io"
    [mount] = epp["volumeMounts"]
    assert flags["config-file"].startswith(mount["mountPath"] + "/")
    [volume] = [v for v in deployment["volumes"] if v["name"] == mount["name"]]
    config_map = named(objects, "ConfigMap", volume["configMap"]["name"])
    assert flags["config-file"].rsplit("/", 1)[1] in config_map["data"]
    service = named(objects, "Service", "flagstop-epp")
    assert selects(service["spec"]["selector"], named(objects, "Deployment", "flagstop-epp")[
        "spec"]["template"]["metadata"]["labels"])  # fmt: skip
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {
        p["containerPort"] for p in epp["ports"]}  # fmt: skip
