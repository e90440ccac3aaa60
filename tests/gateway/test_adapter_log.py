"""The log line of an adapter load names the adapter when the operator named it (the config file)
and not when a caller did (a load at run time): docs/security.md logs no name a caller chose."""

from __future__ import annotations

import httpx

from tests.conftest import make_lora_adapter, start_admin_gateway


def test_an_adapter_of_the_config_is_named_one_loaded_at_run_time_is_not(model_dir, tmp_path):
    root = tmp_path / "adapters"
    make_lora_adapter(model_dir, root / "configured", seed=1)
    make_lora_adapter(model_dir, root / "run-time", seed=2)
    gateway = start_admin_gateway(model_dir, tmp_path, root, {"operators-adapter": root / "configured"})
    try:
        answer = httpx.post(
            gateway.base_url + "/v1/load_lora_adapter",
            json={"lora_name": "callers-adapter-7f3a", "lora_path": "run-time"},
            headers={"Authorization": "Bearer admin-secret"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
    finally:
        gateway.stop()
    log = gateway.log_path.read_text()
    assert "adapter 'operators-adapter' loaded (1 served)" in log
    assert "an adapter loaded at run time (2 served)" in log
    assert "callers-adapter-7f3a" not in log and "run-time" not in log.replace("at run time", "")
