"""The gateway Deployment as Helm renders it: probes, drain, security, GPUs, volumes, keys."""

from __future__ import annotations

import tomllib
from pathlib import PurePosixPath

import pytest

from gateway.settings import load_settings
from tests.deploy.conftest import EXAMPLES, HASH, RELEASE

FULLNAME = f"{RELEASE}-logprob-gateway"
KEY_A, KEY_B = "alice:" + HASH, "sha256:" + "cd" * 32
PVC = {"source": "pvc", "claimName": "llm-models"}


def _mounts(container: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def _volumes(manifests) -> dict[str, dict]:
    return {v["name"]: v for v in manifests.gateway()["spec"]["template"]["spec"]["volumes"]}


def test_every_probe_asks_health_on_the_served_port(render):
    m = render()
    container = m.container()
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert str(port) == m.env()["LOGPROB_GATEWAY_PORT"] == "8000"
    assert m.env()["LOGPROB_GATEWAY_HOST"] == "0.0.0.0"  # reachable from the kubelet and Service
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = container["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 30 * 60  # large models load slowly
    liveness = container["livenessProbe"]
    assert liveness["failureThreshold"] * liveness["periodSeconds"] >= 60  # no restart on a blip


@pytest.mark.parametrize("grace, pause", [(30, 5), (120, 0)])
def test_termination_grace_covers_the_pause_and_the_drain(render, grace, pause):
    m = render({"gateway": {"shutdownGraceSeconds": grace, "preStopSleepSeconds": pause}})
    spec = m.gateway()["spec"]["template"]["spec"]
    assert m.env()["LOGPROB_GATEWAY_SHUTDOWN_GRACE_S"] == str(grace)
    assert spec["terminationGracePeriodSeconds"] == pause + grace + 15
    pre_stop = m.container().get("lifecycle", {}).get("preStop")
    assert pre_stop == ({"exec": {"command": ["sleep", str(pause)]}} if pause else None)


def test_pods_run_as_non_root_with_a_read_only_root(render):
    m = render()
    pod = m.gateway()["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    context = m.container()["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]


def test_everything_the_gateway_writes_is_on_a_writable_volume(render):
    m = render()
    writable = [PurePosixPath(p) for p, mount in _mounts(m.container()).items() if not mount.get("readOnly")]
    env = m.env()
    for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "LOGPROB_GATEWAY_CACHE_DIR", "TRITON_HOME"):
        path = PurePosixPath(env[var])
        assert any(path == w or w in path.parents for w in writable), (var, path)
    assert {"/tmp", "/dev/shm", "/cache"} <= {str(w) for w in writable}
    volumes = _volumes(m)
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["cache"]["emptyDir"]["sizeLimit"] == "20Gi"
    cache = render({"cacheStorage": {"source": "pvc", "claimName": "gw-cache"}})
    assert _volumes(cache)["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": "gw-cache"}}


@pytest.mark.parametrize("count", [0, 1, 2])
def test_gpus_are_requested_and_limited(render, count):
    m = render({"gpu": {"count": count}})
    resources = m.container()["resources"]
    for part in ("requests", "limits"):
        assert resources[part].get("nvidia.com/gpu") == (count or None), part
    assert resources["requests"]["memory"] == "16Gi" and resources["limits"]["memory"] == "32Gi"


def test_scheduling_values_reach_the_pod(render):
    m = render(example="vllm-pvc.yaml")
    pod = m.gateway()["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    assert (
        render({"affinity": affinity, "runtimeClassName": "nvidia"})
        .gateway()["spec"]["template"]["spec"]
        .items()
        >= {"affinity": affinity, "runtimeClassName": "nvidia"}.items()
    )


@pytest.mark.parametrize(
    "storage, volume",
    [
        (
            {"source": "pvc", "claimName": "llm-models"},
            {"persistentVolumeClaim": {"claimName": "llm-models", "readOnly": True}},
        ),
        (
            {"source": "hostPath", "hostPath": "/data/models"},
            {"hostPath": {"path": "/data/models", "type": "Directory"}},
        ),
        ({"source": "none"}, None),
    ],
)
def test_models_and_adapters_come_from_a_pvc_or_a_node_directory(render, storage, volume):
    m = render({"modelStorage": storage, "adapterStorage": storage})
    volumes, mounts = _volumes(m), _mounts(m.container())
    for name, path in (("models", "/models"), ("adapters", "/adapters")):
        if volume is None:
            assert name not in volumes and path not in mounts
        else:
            assert volumes[name] == {"name": name, **volume}
            assert mounts[path] == {"name": name, "mountPath": path, "readOnly": True}


@pytest.mark.parametrize(
    "model", [{"model": "/models/llama"}, {"model": "smollm2-135m", "adapters": {"a": "/adapters/a"}}]
)
def test_paths_on_a_volume_that_is_not_mounted_fail_at_install(render, model):
    import helm_python

    with pytest.raises(helm_python.HelmRenderError, match="no volume is mounted there"):
        render({"config": {"models": [model]}})
    render({"config": {"models": [model]}, "modelStorage": PVC, "adapterStorage": PVC})


def test_config_file_is_mounted_where_the_env_points(render):
    m = render()
    path = PurePosixPath(m.env()["LOGPROB_GATEWAY_CONFIG"])
    mount = _mounts(m.container())[str(path.parent)]
    assert _volumes(m)[mount["name"]]["configMap"]["name"] == FULLNAME
    assert path.name in m.get("ConfigMap", FULLNAME)["data"]


@pytest.mark.parametrize("example", [None, *(p.name for p in EXAMPLES)])
def test_config_toml_parses_and_loads_as_the_values_say(render, chart, example, tmp_path):
    m = render(example=example)
    text = m.config_toml()
    values = chart.merge_values(_example_values(example))["config"]
    assert tomllib.loads(text) == values  # integral floats compare equal to the ints written
    config = tmp_path / "config.toml"
    config.write_text(text)
    settings = load_settings(config, environ={})
    assert [s.served_name for s in settings.models] == [v["name"] for v in values["models"]]
    assert settings.cache.redis_url is None  # the URL comes from the env the chart sets


def test_config_toml_writes_any_value_faithfully(render, tmp_path):
    tricky = {
        "name": 'a "quoted" \\ name é',
        "model": "/models/x y",
        "backend": "vllm",
        "max_model_len": 4096,
        "adapters": {"v1.2": "/adapters/v1.2", "plain_name": "/adapters/p"},
        "weights_root": "/models/checkpoints",
        "options": {
            "tensor_parallel_size": 2,
            "gpu_memory_utilization": 0.9,
            "flags": [1, "two", True],
            "nested": {"k": 1e-05},
        },
    }
    limits = {"max_rows": 64, "max_body_bytes": 2**26}  # Go prints a float of 2**26 as 6.7108864e+07
    parsed = tomllib.loads(
        render(
            {"config": {"models": [tricky], "limits": limits}, "modelStorage": PVC, "adapterStorage": PVC}
        ).config_toml()
    )
    assert parsed["models"] == [tricky] and parsed["limits"] == limits
    options = parsed["models"][0]["options"]
    # integers stay integers: engines get tensor_parallel_size=2, not 2.0
    assert type(options["tensor_parallel_size"]) is int and type(parsed["models"][0]["max_model_len"]) is int
    assert type(parsed["limits"]["max_body_bytes"]) is int
    assert type(options["gpu_memory_utilization"]) is float


def _example_values(example: str | None) -> dict:
    if example is None:
        return {}
    import helm_python

    from tests.deploy.conftest import CHART

    return helm_python.values_from_yaml((CHART.parent / "examples" / example).read_text())


def test_keys_in_values_become_a_secret_of_hashes(render):
    m = render({"auth": {"apiKeys": [KEY_A, KEY_B], "adminKey": HASH}})
    secret = m.get("Secret", f"{FULLNAME}-auth")["stringData"]
    assert secret["api-keys"].splitlines() == [KEY_A, KEY_B]
    assert secret["admin-key"] == HASH
    env = m.env()
    assert env["LOGPROB_GATEWAY_ADMIN_KEY"] == {
        "secretKeyRef": {"name": f"{FULLNAME}-auth", "key": "admin-key", "optional": True}
    }
    keys_file = PurePosixPath(env["LOGPROB_GATEWAY_API_KEYS_FILE"])
    mount = _mounts(m.container())[str(keys_file.parent)]
    volume = _volumes(m)[mount["name"]]["secret"]
    assert volume["secretName"] == f"{FULLNAME}-auth"
    assert volume["items"] == [{"key": "api-keys", "path": keys_file.name}]
    assert "optional" not in volume  # no keys: the pod waits rather than serving without auth
    other = render({"auth": {"apiKeys": [KEY_A]}}).gateway()["spec"]["template"]["metadata"]["annotations"]
    annotations = m.gateway()["spec"]["template"]["metadata"]["annotations"]
    assert other["checksum/auth"] != annotations["checksum/auth"]  # new keys roll the pods


def test_an_existing_secret_is_used_as_it_is(render):
    m = render({"auth": {"existingSecret": "lab-keys"}})
    assert "Secret" not in m.kinds()
    assert _volumes(m)["auth"]["secret"]["secretName"] == "lab-keys"
    assert m.env()["LOGPROB_GATEWAY_ADMIN_KEY"]["secretKeyRef"]["name"] == "lab-keys"


def test_without_keys_the_notes_say_how_to_create_them(render):
    notes = render().notes
    assert f"create secret generic {FULLNAME}-auth --from-file=api-keys=" in notes
    assert "hash-key" in notes


def test_auth_can_be_turned_off_and_the_notes_warn(render):
    m = render({"auth": {"enabled": False}})
    assert "LOGPROB_GATEWAY_API_KEYS_FILE" not in m.env() and "LOGPROB_GATEWAY_ADMIN_KEY" not in m.env()
    assert "auth" not in _volumes(m)
    assert "WARNING: auth.enabled is false" in m.notes


@pytest.mark.parametrize("public", [True, False])
def test_metrics_public_reaches_the_gateway(render, public):
    assert (
        render({"gateway": {"metricsPublic": public}}).env()["LOGPROB_GATEWAY_METRICS_PUBLIC"]
        == str(public).lower()
    )


def test_notes_show_the_openai_sdk_and_the_dense_endpoint(render):
    values = {"config": {"models": [{"name": "llama", "model": "/models/llama"}]}, "modelStorage": PVC}
    notes = render(values).notes
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=' in notes
    assert 'client.post("/next_token_logprobs"' in notes and "POST /v1/next_token_logprobs" in notes
    assert 'model="llama"' in notes and f"port-forward svc/{FULLNAME} 8000:8000" in notes


def test_image_tag_defaults_to_the_app_version_and_a_digest_wins(render, chart):
    assert render().container()["image"] == f"logprob-gateway:{chart.metadata['appVersion']}"
    digest = "sha256:" + "0" * 64
    image = render({"image": {"repository": "r.example/gw", "tag": "x", "digest": digest}}).container()[
        "image"
    ]
    assert image == f"r.example/gw@{digest}"


def test_the_fleet_example_puts_the_router_in_front_of_the_gateway_pods(render):
    """helm/examples/fleet.yaml: SMG's Deployment finds exactly the gateway pods by their labels,
    may list and watch pods and nothing else, and its Service is what clients use."""
    m = render(_example_values("fleet.yaml"))
    router = m.get("Deployment", f"{FULLNAME}-router")
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["smg", "launch"]
    args = container["args"]
    assert "--service-discovery" in args and "--policy=cache_aware" in args
    assert "--routing-key-override" in args and "--assignment-mode=min_group" in args
    unkeyed = render({**_example_values("fleet.yaml"), "router": {"enabled": True, "routingKeys": False}})
    keyless = unkeyed.get("Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]["containers"][0]
    assert "--routing-key-override" not in keyless["args"]
    labels = m.gateway()["spec"]["template"]["metadata"]["labels"]
    selected = args[args.index("--selector") + 1 : args.index("--selector") + 4]
    assert {tuple(s.split("=")) for s in selected} <= set(labels.items())
    assert "component=gateway" in " ".join(selected)
    assert f"--service-discovery-port={m.container()['ports'][0]['containerPort']}" in args
    assert m.gateway()["spec"]["replicas"] == 4
    role = m.get("Role", f"{FULLNAME}-router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = m.get("RoleBinding", f"{FULLNAME}-router")
    assert binding["subjects"][0]["name"] == router["spec"]["template"]["spec"]["serviceAccountName"]
    service = m.get("Service", f"{FULLNAME}-router")
    assert service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert not [
        o for o in render().objects if o["metadata"]["name"] == f"{FULLNAME}-router"
    ]  # off by default
