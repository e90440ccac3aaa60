"""`helm lint` through Helm's Go library, by two independent bindings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.deploy.conftest import CHART, EXAMPLES, require

WARNING = 2  # Helm's lint severities: 1 info, 2 warning, 3 error

# helm-sdkpy's Lint takes only the chart (its values.yaml). It runs in its own process: it embeds
# a second Go runtime, which is best not shared with helm-python-sdk's in one process.
_SDKPY_LINT = """
import asyncio, json, sys
import helm_sdkpy
report = asyncio.run(helm_sdkpy.Lint(helm_sdkpy.Configuration()).run(sys.argv[1]))
print(json.dumps(report))
"""


def test_helm_sdkpy_lints_the_default_values_clean():
    require("helm_sdkpy")
    done = subprocess.run(
        [sys.executable, "-c", _SDKPY_LINT, str(CHART)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["TotalChartsLinted"] == 1
    assert not report["Errors"]
    # this binding drops the messages' text; helm_python's lint below gives it
    assert all(m["Severity"] < WARNING for m in report["Messages"]), report["Messages"]


@pytest.mark.parametrize("values_file", [None, *EXAMPLES], ids=lambda p: p.name if p else "defaults")
def test_lint_is_clean_in_strict_mode(values_file):
    helm = require("helm_python")
    values = helm.values_from_yaml(values_file.read_text()) if values_file else None
    report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert report["total_charts_linted"] == 1
    assert not report["errors"] and not problems, problems or report["errors"]


def test_lint_reports_values_that_break_the_schema():
    helm = require("helm_python")
    report = helm.lint(CHART, {"gpu": {"count": -1}}, strict=True)
    errors = [m["error"] for m in report["messages"] if m["severity"] > WARNING]
    assert any("/gpu/count" in e for e in errors), report
