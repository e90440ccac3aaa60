"""The documentation holds: every relative link of README.md and docs/*.md reaches a file, and its
`#anchor` a heading of that file (as GitHub names headings); the example config of
docs/configuration.md loads through the real settings loader and serves."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import httpx
import pytest

from bench.launcher import start_gateway
from gateway.server.preflight import check_before_loading
from gateway.settings import load_settings

REPO = Path(__file__).parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(
    r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)"
)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: its text as shown (no code marks, link text only), lowercased,
    punctuation dropped except - and _, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(document: Path) -> set[str]:
    text = FENCE.sub("", document.read_text())
    seen: Counter[str] = Counter()
    out = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(text):
        anchor = github_anchor(heading)
        out.add(anchor if not seen[anchor] else f"{anchor}-{seen[anchor]}")  # repeats get -1, -2, ...
        seen[anchor] += 1
    return out


def relative_links(document: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", document.read_text()))
    targets = [a or b for a, b in LINK.findall(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # no http:, mailto:, ...


def broken_links(document: Path) -> list[str]:
    broken = []
    for target in relative_links(document):
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no such heading in {resolved.name}")
    return broken


def test_github_anchor_names_headings_as_github_does():
    assert github_anchor("Use it with the official `openai` SDK") == "use-it-with-the-official-openai-sdk"
    assert github_anchor("H200: vLLM 0.26, beside the transformers engine") == (
        "h200-vllm-026-beside-the-transformers-engine"
    )
    assert github_anchor("LoRA adapters (`model=base:adapter`)") == "lora-adapters-modelbaseadapter"


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Present\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](other.md#present) [b](other.md#twice-1) [c](#here) [d](https://x.org/#y)\n"
        "[e](other.md#absent) [f](missing.md) `[g](missing.md)`\n\n## Here\n"
    )
    assert broken_links(page) == ["other.md#absent: no such heading in other.md", "missing.md: no such file"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(document):
    assert broken_links(document) == []


def example_config() -> str:
    text = (REPO / "docs" / "configuration.md").read_text()
    return re.search(r"```toml\n(.*?)```", text, re.S).group(1)


def test_the_example_config_loads_and_passes_the_checks_before_loading(tmp_path, model_dir):
    config = tmp_path / "gateway.toml"
    # the one path that must exist: the directory docs/configuration.md has you download
    config.write_text(example_config().replace('"models/smollm2"', f'"{model_dir}"'))
    settings = load_settings(str(config), {})
    assert [m.name for m in settings.models] == ["smollm2-135m", "smollm2-hub"]
    assert check_before_loading(settings) == []
    gateway = start_gateway(["--config", str(config)], tmp_path / "gateway.log")
    try:
        served = httpx.get(gateway.base_url + "/v1/models").json()["data"]
        assert [m["id"] for m in served] == ["smollm2-135m", "smollm2-hub"]
    finally:
        gateway.stop()
