"""The environment of a gateway a bench starts: without the VLLM_* variables that importing
genlm-backend set in the bench's process (bench/launcher.py `child_environment`,
`restore_vllm_environment`)."""

from __future__ import annotations

import os

from bench import launcher


def test_a_child_gets_the_vllm_variables_this_process_started_with(monkeypatch):
    monkeypatch.setattr(launcher, "_VLLM_AT_START", {"VLLM_KEPT": "a", "VLLM_CHANGED": "old"})
    monkeypatch.setenv("VLLM_KEPT", "a")
    monkeypatch.setenv("VLLM_CHANGED", "new")  # as importing genlm-backend changes them
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # and adds them
    child = launcher.child_environment(None)
    assert child["VLLM_KEPT"] == "a" and child["VLLM_CHANGED"] == "old"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in child
    assert child["PATH"] == os.environ["PATH"]


def test_what_a_caller_sets_for_its_child_is_kept(monkeypatch):
    monkeypatch.setattr(launcher, "_VLLM_AT_START", {})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0", "CUDA_VISIBLE_DEVICES": "1"}
    assert launcher.child_environment(env) == env


def test_this_process_gets_its_vllm_variables_back(monkeypatch):
    monkeypatch.setattr(launcher, "_VLLM_AT_START", {"VLLM_CHANGED": "old"})
    monkeypatch.setenv("VLLM_CHANGED", "new")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    launcher.restore_vllm_environment()
    assert os.environ["VLLM_CHANGED"] == "old" and "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
