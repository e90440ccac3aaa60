"""A served model's chat template and tool-call format, as its settings choose them.

`chat_template` replaces the template the tokenizer came with, on the tokenizer itself, so that
chat requests, /v1/tokenize and the tokenizer's files all see the one that is served:
- unset: the built-in model's shipped template where it has one (`BUILTIN_TEMPLATES`), else the
  tokenizer's own;
- `"tokenizer"`: the tokenizer's own;
- the name of a template shipped in gateway/chat_templates/ (`smollm2-tools`);
- else a Jinja file, relative to `chat_templates_root` or absolute, which must lie inside that
  root once symlinks are resolved: settings may come from values files that others write, and a
  template is rendered with every request's messages, so, as adapters' and weights' directories,
  it is read only where the operator said files may be.

`tool_call_format` names one of the formats gateway/openai/tool_formats.py reads (Hermes, Llama 3
JSON, Mistral); unset, the served template's text says which, if any.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import jinja2
import jinja2.sandbox

from gateway.openai.tool_formats import TOOL_FORMATS, ToolFormat, template_format
from gateway.settings import ConfigError, ModelSettings

SHIPPED = resources.files("gateway") / "chat_templates"
OWN = "tokenizer"  # the value that keeps the tokenizer's own template
# Built-in models served with a shipped template unless their settings say otherwise: SmolLM2's
# own template shows no tools, so "auto" would be refused; this one renders every conversation
# without tools exactly as the model's own does.
BUILTIN_TEMPLATES = {"smollm2-135m": "smollm2-tools"}


def shipped_templates() -> list[str]:
    """The names of the templates shipped with the gateway."""
    return sorted(
        entry.name.removesuffix(".jinja") for entry in SHIPPED.iterdir() if entry.name.endswith(".jinja")
    )


def chat_template_text(settings: ModelSettings) -> str | None:
    """The text of the template that replaces the tokenizer's; None: the tokenizer's own stays.
    ConfigError (one line, without the model's name) for a value that names no shipped template
    and no readable Jinja file inside `chat_templates_root`. Reads the filesystem: call it off
    the event loop."""
    chosen = settings.chat_template
    if chosen is None:
        chosen = BUILTIN_TEMPLATES.get(settings.model, OWN)
    if chosen == OWN:
        return None
    if chosen in shipped_templates():
        return (SHIPPED / f"{chosen}.jinja").read_text(encoding="utf-8")
    return _checked(_template_file_text(chosen, settings.chat_templates_root))


def _template_file_text(given: str, root: str | None) -> str:
    if root is None:
        raise ConfigError(
            f"chat_template {given!r} is no shipped template ({', '.join(shipped_templates())}) nor "
            f'"{OWN}"; a template file must lie inside chat_templates_root, which is not set'
        )
    try:
        base = Path(root).resolve()
        if not base.is_dir():
            raise ConfigError(f"chat_templates_root {root!r} is not a directory")
        path = (base / given).resolve()
        if not path.is_relative_to(base):  # a symlink inside that leads out counts as outside
            raise ConfigError(f"chat_template {given!r} lies outside chat_templates_root {root!r}")
        if not path.is_file():
            raise ConfigError(f"chat_template {given!r}: no such file in chat_templates_root {root!r}")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"chat_template {given!r} is not UTF-8 text") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: pathlib's report of a symlink loop
        raise ConfigError(f"chat_template {given!r} is not a usable path: {exc}") from None


def _checked(text: str) -> str:
    """`text` once Jinja parses it: a broken template stops the start, not every chat request."""
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(
            f"chat_template is not a valid Jinja template: line {exc.lineno}: {exc.message}"
        ) from None
    return text


def served_tool_format(settings: ModelSettings, template: str | dict[str, str] | None) -> ToolFormat | None:
    """The format of the model's tool calls: the one its settings name, else the one the served
    `template` shows (None: it shows none). Where both agree, what the template tells beyond the
    name (Llama 3.1's single call per turn) is kept."""
    if isinstance(template, dict):  # named templates ("default", "tool_use"): any may show calls
        template = "\n".join(str(text) for text in template.values())
    shown = template_format(template or "")
    named = settings.tool_call_format
    if named is None or (shown is not None and shown.name == named):
        return shown
    return TOOL_FORMATS[named]
