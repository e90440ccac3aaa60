"""A request's grammar as llguidance's grammar text, and the limits llguidance enforces itself.

This is the untrusted part of a compile (parsing a JSON schema, converting GBNF to Lark in pure
Python, reading a regex): it runs in a grammar worker process (backends/grammar/worker.py),
never in the gateway's own, which only builds matchers from the text a worker returned.
"""

from __future__ import annotations

import json

import llguidance

from backends.errors import GrammarError
from backends.types import GRAMMAR_KINDS, Grammar

# JSON on one line, with no whitespace between tokens: whitespace allowed anywhere lets a small
# model emit newlines until max_tokens. vLLM's `disable_any_whitespace` and SGLang's
# `constrained_json_disable_any_whitespace` give the same grammar. A schema's own "x-guidance"
# options override these.
COMPACT_JSON = {"whitespace_flexible": False}
MAX_MESSAGE = 1000  # characters of a grammar engine's message passed on

# llguidance's own bounds on a compile and on each token mask (its `LLParserLimits`), set here
# rather than left to the library's defaults, so that an upgrade cannot loosen them unseen.
PARSER_LIMITS = {
    "max_items_in_row": 2000,  # alternatives of one rule (a `choice` of more is refused)
    "initial_lexer_fuel": 1_000_000,  # work building the lexer's regexes (~20 ms)
    "step_lexer_fuel": 200_000,  # lexer work per token mask (~15 ms)
    "step_max_items": 50_000,  # Earley items per token mask (~2.5 ms)
    "max_lexer_states": 250_000,  # lexer states (1-2 kB each: ~0.5 GB at most)
    "max_grammar_size": 500_000,  # symbols in the grammar's rules
    "precompute_large_lexemes": True,
    # without it an error names no part of the grammar, so none of a request's text is logged
    "verbose_errors": False,
}


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def one_line_error(message: str) -> GrammarError:
    """The grammar engine's message on one line (it draws carets under the source on several)."""
    line = " ".join(message.replace("<non-verbose/>", "").split())  # the mark of verbose_errors off
    return GrammarError(line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "...")


def ascii_digits(regex: str) -> str:
    """`\\d` as [0-9], as Python's `re.ASCII`, xgrammar and JSON schema patterns read it (Rust's
    regex syntax, llguidance's, reads it as any Unicode digit)."""
    out: list[str] = []
    i, class_start = 0, -1  # where the bracket expression being read began, -1: outside one
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            pair = regex[i : i + 2]
            out.append(("0-9" if class_start >= 0 else "[0-9]") if pair == "\\d" else pair)
            i += 2
            continue
        if char == "[" and class_start < 0:
            class_start = i
        elif char == "]" and class_start >= 0 and i > class_start + 1 + (regex[class_start + 1] == "^"):
            class_start = -1  # a "]" first in the class is a literal
        out.append(char)
        i += 1
    return "".join(out)


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar for `grammar`; GrammarError where its text cannot be read as its kind."""
    if grammar.kind not in GRAMMAR_KINDS:
        raise one_line_error(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, not {grammar.kind!r}")
    try:
        if grammar.kind == "json_schema":
            schema = json.loads(grammar.source)
            if not isinstance(schema, dict | bool):
                raise one_line_error(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
        if grammar.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_digits(grammar.source))
        return llguidance.grammar_from(grammar.kind, grammar.source)
    except GrammarError:
        raise
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        raise one_line_error(f"invalid {grammar.kind}: {exc}") from None
