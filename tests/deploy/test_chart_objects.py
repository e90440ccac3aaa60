"""The other objects: Redis (both ways), Service, Ingress, HPA, PDB, ServiceMonitor, dashboard;
and every object against Kubernetes' own API schemas."""

from __future__ import annotations

import json

import pytest

from tests.deploy.conftest import CHART, EXAMPLES, RELEASE, require

FULLNAME = f"{RELEASE}-logprob-gateway"
REDIS = f"{FULLNAME}-redis"
EVERYTHING_ON = {
    "auth": {"apiKeys": ["sha256:" + "ab" * 32], "adminKey": "sha256:" + "cd" * 32},
    "ingress": {
        "enabled": True,
        "className": "nginx",
        "tls": [{"hosts": ["gw.example.org"], "secretName": "t"}],
    },
    "autoscaling": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
    "modelStorage": {"source": "pvc", "claimName": "models"},
    "adapterStorage": {"source": "hostPath", "hostPath": "/data/adapters"},
    "redis": {"auth": {"existingSecret": "redis-pass"}},
    "gateway": {"extraEnv": [{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}]},
}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def _pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_in_chart_redis_is_a_bounded_lru_cache_without_persistence(render):
    m = render()
    redis = m.get("Deployment", REDIS)
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert options == {
        "--save": "",
        "--appendonly": "no",
        "--maxmemory": "2gb",
        "--maxmemory-policy": "allkeys-lru",
    }
    assert m.env()["LOGPROB_GATEWAY_REDIS_URL"] == f"redis://{REDIS}:6379/0"
    service = m.get("Service", REDIS)
    assert _matches(service["spec"]["selector"], _pod_labels(redis))
    assert not _matches(service["spec"]["selector"], _pod_labels(m.gateway()))


def test_only_gateway_pods_may_reach_redis(render):
    m = render()
    policy = m.get("NetworkPolicy", REDIS)["spec"]
    assert _matches(policy["podSelector"]["matchLabels"], _pod_labels(m.get("Deployment", REDIS)))
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert _matches(peer["podSelector"]["matchLabels"], _pod_labels(m.gateway()))
    assert not _matches(peer["podSelector"]["matchLabels"], _pod_labels(m.get("Deployment", REDIS)))
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]


def test_redis_password_reaches_both_sides(render):
    m = render({"redis": {"auth": {"existingSecret": "redis-pass"}}})
    env = m.container()["env"]
    names = [e["name"] for e in env]
    # Kubernetes expands $(VAR) only from variables defined earlier in the list
    assert names.index("REDIS_PASSWORD") < names.index("LOGPROB_GATEWAY_REDIS_URL")
    assert m.env()["LOGPROB_GATEWAY_REDIS_URL"] == f"redis://:$(REDIS_PASSWORD)@{REDIS}:6379/0"
    redis = m.get("Deployment", REDIS)["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert redis["env"][0]["valueFrom"] == {"secretKeyRef": {"name": "redis-pass", "key": "redis-password"}}


@pytest.mark.parametrize(
    "redis, url",
    [
        ({"enabled": False, "externalUrl": "redis://cache.lab:6379/2"}, "redis://cache.lab:6379/2"),
        (
            {"enabled": False, "externalUrlSecret": {"name": "shared", "key": "url"}},
            {"secretKeyRef": {"name": "shared", "key": "url"}},
        ),
        ({"enabled": False}, None),  # each pod keeps an in-process cache
    ],
)
def test_external_or_no_redis(render, redis, url):
    m = render({"redis": redis})
    assert m.env().get("LOGPROB_GATEWAY_REDIS_URL") == url
    assert not [o for o in m.objects if "redis" in o["metadata"]["name"]]


def test_service_ingress_hpa_pdb_and_servicemonitor_point_at_the_gateway(render):
    m = render(EVERYTHING_ON)
    gateway = m.gateway()
    pod_labels = _pod_labels(gateway)
    service = m.get("Service", FULLNAME)
    assert _matches(service["spec"]["selector"], pod_labels)
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    backend = m.get("Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": FULLNAME, "port": {"name": "http"}}
    hpa = m.get("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert "replicas" not in gateway["spec"]  # the HPA owns the replica count
    pdb = m.get("PodDisruptionBudget")["spec"]
    assert _matches(pdb["selector"]["matchLabels"], pod_labels) and pdb["maxUnavailable"] == 1
    monitor = m.get("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    ]


def test_optional_objects_are_off_by_default(render):
    kinds = render().kinds()
    assert not kinds & {"Ingress", "HorizontalPodAutoscaler", "ServiceMonitor", "Secret"}
    assert {"PodDisruptionBudget", "NetworkPolicy", "ServiceAccount"} <= kinds


def test_min_available_wins_over_max_unavailable(render):
    pdb = render(example="external-redis.yaml").get("PodDisruptionBudget")["spec"]
    assert pdb["minAvailable"] == 1 and "maxUnavailable" not in pdb


def test_private_metrics_are_scraped_with_a_key(render):
    values = {
        "gateway": {"metricsPublic": False},
        "serviceMonitor": {"enabled": True, "bearerTokenSecret": {"name": "scrape", "key": "key"}},
    }
    (endpoint,) = render(values).get("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "scrape", "key": "key"}}


def test_dashboard_ships_for_the_grafana_sidecar(render):
    config_map = render().get("ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["logprob-gateway.json"])
    assert shipped == json.loads((CHART / "dashboards" / "logprob-gateway.json").read_text())
    without = render({"grafanaDashboard": {"enabled": False}}).objects
    assert [o["metadata"]["name"] for o in without if o["kind"] == "ConfigMap"] == [FULLNAME]


@pytest.mark.parametrize("kube", ["1.25", "1.30", None])
@pytest.mark.parametrize(
    "values, example", [({}, None), (EVERYTHING_ON, None), *(({}, p.name) for p in EXAMPLES)]
)
def test_objects_are_valid_kubernetes_api_objects(render, kube, values, example):
    validator = require("kubernetes_validate")
    version = kube or validator.latest_version()
    for obj in render(values, example=example).objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: not in Kubernetes' own schemas
        # strict: unknown fields (typos, wrong nesting) are errors too
        validator.validate(obj, version, strict=True)


def test_long_release_names_still_give_valid_names(chart):
    from tests.deploy.conftest import Manifests

    release = "a" * 53  # Helm's limit
    m = Manifests(chart.render(EVERYTHING_ON, name=release, namespace="lab"))
    names = [(o["kind"], o["metadata"]["name"]) for o in m.objects]
    assert all(len(n) <= 63 and not n.endswith("-") for _, n in names), names
    assert len(set(names)) == len(names)  # shortened names still differ within each kind
    assert len([n for kind, n in names if kind == "Deployment"]) == 2
