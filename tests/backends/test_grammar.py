"""Generation held to a grammar, on the engines that sample themselves (real transformers and MLX
engines on the default model): each token is the most likely one the grammar allows, its reported
logprob is the model's before the mask, constrained streams share passes with unconstrained ones,
and grammars compile once, within a bound, or are refused."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest

from backends.errors import GrammarError
from backends.grammar.constraint import ascii_digits, grammar_text
from backends.transformers.engine import TransformersEngine
from backends.types import EngineConfig, Grammar, SamplingParams
from tests.gateway.grammar_families import gbnf_chain, lark_chain, ref_chain
from tests.gateway.structured_cases import ARITHMETIC, REGEXES, SCHEMAS

DATE = Grammar("regex", REGEXES["date"][0])
PERSON = Grammar("json_schema", json.dumps(SCHEMAS[3]))


@pytest.fixture(scope="module")
def engine(model_dir):
    return TransformersEngine.load(EngineConfig(model=str(model_dir), dtype="float32"))


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


async def generate(engine, ids, grammar=None, max_tokens=48, **params):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar, **params)
    return [step async for step in engine.generate(ids, sampling)]


def text_of(engine, steps) -> str:
    return engine.info.tokenizer.decode([s.token_id for s in steps], skip_special_tokens=True)


def allowed_masks(tokenizer, vocab_size, eos, grammar: Grammar, tokens: list[int]) -> list[np.ndarray]:
    """The grammar's mask before each of `tokens`, from a matcher of llguidance's own."""
    matcher = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos)),
        grammar_text(grammar),
    )
    masks = []
    for token in tokens:
        bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        masks.append(np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool))
        assert matcher.consume_token(token)
    return masks


async def test_each_token_is_the_best_allowed_and_reports_the_raw_logprob(engine, reference):
    ids = chat_ids(engine.info.tokenizer, "Describe a person you know as a JSON object.")
    steps = await generate(engine, ids, PERSON, max_tokens=64, top_logprobs=3)
    assert steps[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(engine, steps)), SCHEMAS[3])
    tokens = [s.token_id for s in steps]
    rows = reference.logprobs(ids + tokens)[len(ids) - 1 : -1]
    masks = allowed_masks(
        engine.info.tokenizer, engine.info.vocab_size, engine.info.eos_token_ids, PERSON, tokens
    )
    for step, row, mask in zip(steps, rows, masks, strict=True):
        assert mask[step.token_id]
        # the most likely allowed token (a near tie may go either way in float32)
        assert row[step.token_id] >= row[mask].max() - 1e-4
        # reported: the model's own distribution, before the mask, as a forward pass gives it
        assert step.logprob == pytest.approx(row[step.token_id], abs=1e-4)
        np.testing.assert_array_equal(step.top_ids, np.argsort(-row, kind="stable")[:3])
    assert any(not mask[int(np.argmax(row))] for row, mask in zip(rows, masks, strict=True))  # it did steer


async def test_regexes_and_an_arithmetic_grammar_hold(engine):
    for name, (pattern, question) in REGEXES.items():
        steps = await generate(engine, chat_ids(engine.info.tokenizer, question), Grammar("regex", pattern))
        assert steps[-1].finish_reason == "stop", name
        assert re.fullmatch(pattern, text_of(engine, steps), re.ASCII), name
    steps = await generate(
        engine,
        chat_ids(engine.info.tokenizer, "Write a sum of three numbers."),
        Grammar("ebnf", ARITHMETIC),
        64,
    )
    text = text_of(engine, steps)
    assert steps[-1].finish_reason == "stop" and re.fullmatch(r"[0-9+\-*/()]+", text), text
    assert isinstance(eval(compile(text, "<grammar>", "eval")), int | float)  # noqa: S307 (digits and operators only)


async def test_constrained_streams_share_passes_and_leave_others_unchanged(engine):
    prompts = [
        chat_ids(engine.info.tokenizer, f"Tell me about {topic}.")
        for topic in ("cats", "rain", "tea", "jazz")
    ]
    alone = [await generate(engine, ids, max_tokens=16) for ids in prompts]
    # compiled first, as the routes do, so that the constrained streams start with the others
    # rather than a compile later on a busy machine
    person, date = [await engine.structured_outputs.check(g, timeout_s=60.0) for g in (PERSON, DATE)]
    passes = engine.status().pass_stats.passes
    together = await asyncio.gather(
        *(generate(engine, ids, max_tokens=16) for ids in prompts),
        *(generate(engine, ids, person, max_tokens=16) for ids in prompts[:2]),
        *(generate(engine, ids, date, max_tokens=16) for ids in prompts[2:]),
    )
    for own, shared in zip(alone, together[:4], strict=True):
        assert [s.token_id for s in shared] == [s.token_id for s in own]
        np.testing.assert_allclose([s.logprob for s in shared], [s.logprob for s in own], atol=1e-4)
    # eight streams of up to 16 tokens each: far fewer passes than the 8 x 16 they would take alone
    after = engine.status().pass_stats
    assert after.passes - passes <= 2 * 16 and after.largest >= 8
    for steps in together[4:6]:
        assert text_of(engine, steps).startswith("{")


async def test_grammars_compile_once_and_within_the_bound(engine):
    grammars = engine.structured_outputs
    schema = Grammar("json_schema", json.dumps({**SCHEMAS[-1], "title": f"once {uuid.uuid4()}"}))
    checked = await asyncio.gather(*(grammars.check(schema, 10.0) for _ in range(4)))
    compiled = checked[0].compiled
    assert compiled is not None and all(each.compiled is compiled for each in checked)  # one compile
    assert (await grammars.check(schema, 1e-9)).compiled is compiled  # kept: no compile, no time needed
    # GBNF whose conversion to Lark alone takes seconds: refused at its bound, its worker killed
    slow = Grammar("ebnf", gbnf_chain(2000, tag=uuid.uuid4().hex[:6]))
    started = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile within 0.3 s"):
        await grammars.check(slow, 0.3)
    assert time.monotonic() - started < 0.3 + 3.0  # a worker's start at most, besides the bound
    started = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile within 0.3 s"):
        await grammars.check(slow, 10.0)  # the verdict is kept, failures too
    assert time.monotonic() - started < 0.1


async def test_generation_uses_what_the_check_compiled(engine, monkeypatch):
    """A grammar dropped from the kept ones between its check and its generation is not compiled
    again (that second compile had no bound): the check's matcher travels with the grammar."""
    grammars = engine.structured_outputs
    schema = ref_chain(6, leaf={"enum": ["done"]})
    checked = await grammars.check(
        Grammar("json_schema", json.dumps({**schema, "title": str(uuid.uuid4())})), 10.0
    )
    grammars._kept.clear()

    def compile_again(*_):
        raise AssertionError("compiled a second time")

    monkeypatch.setattr(grammars, "_compile", compile_again)
    ids = chat_ids(engine.info.tokenizer, "Write a JSON object.")
    steps = await generate(engine, ids, checked, max_tokens=96)
    assert steps[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(engine, steps)), schema)


@pytest.mark.hostile
async def test_one_streams_tokens_do_not_spend_anothers_lexer_budget(engine):
    """Under `(a|b)*a(a|b){40}` every new a/b token can make a lexer state. Alice's stream runs
    hers out; Bob's, under the same kept grammar, starts with a budget of its own."""
    grammar = await engine.structured_outputs.check(
        Grammar("regex", f"(a|b)*a(a|b){{40}}(x{uuid.uuid4().hex[:4]})?"), 10.0
    )
    vocab = engine.info.tokenizer.get_vocab()
    ab = [i for token, i in vocab.items() if token and set(token) <= {"a", "b"}]
    rng = np.random.default_rng(0)
    alice = await engine.structured_outputs.constraint(grammar)
    accepted = 0
    # Every a/b text is a prefix the grammar allows: what stops Alice is her lexer's budget,
    # which llguidance reports as "too many states" or, run out within a token, as a failed parse.
    with pytest.raises(GrammarError, match="lexer error: too many|fails parse"):
        for token in rng.choice(ab, 200_000):
            alice.accept(int(token))
            accepted += 1
    assert accepted > 1_000
    bob = await engine.structured_outputs.constraint(grammar)
    for token in rng.choice(ab, 100):
        assert (await bob.next_mask())[token]
        bob.accept(int(token))


@pytest.mark.hostile
async def test_kept_verdicts_hold_at_most_their_bytes(engine, monkeypatch):
    """Kept grammars are bounded by the bytes of their text, not only by their count; one larger
    than the bound is not kept, and is compiled again (within its bound) when asked again."""
    from backends.grammar import constraint

    monkeypatch.setattr(constraint, "MAX_KEPT_BYTES", 400_000)
    grammars = engine.structured_outputs
    tag = uuid.uuid4().hex[:6]

    def words(n: int, i: int) -> Grammar:
        return Grammar("regex", "|".join(f"{tag}{i}w{k}" for k in range(n)))

    for i in range(4):
        await grammars.check(words(8_000, i), 30.0)  # about 100 kB of source, and of text
        assert grammars._kept_bytes <= 400_000
    assert words(8_000, 0) not in grammars._kept and words(8_000, 3) in grammars._kept
    huge = words(40_000, 9)
    checked = await grammars.check(huge, 30.0)
    assert huge not in grammars._kept
    steps = await generate(engine, chat_ids(engine.info.tokenizer, "Say a word."), checked, max_tokens=32)
    assert re.fullmatch(f"{tag}9w[0-9]+", text_of(engine, steps))


async def test_a_grammar_that_crashes_the_grammar_engine_costs_a_worker(engine):
    grammars = engine.structured_outputs
    with pytest.raises(GrammarError, match="crashed on this grammar"):
        await grammars.check(Grammar("lark", lark_chain(3000, tag=uuid.uuid4().hex[:6])), 10.0)
    assert (await grammars.check(Grammar("regex", f"ok{uuid.uuid4().hex[:6]}"), 10.0)).compiled is not None


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (Grammar("regex", "(?<=a)b"), "look-around"),
        (Grammar("regex", "(ab"), "unclosed group"),
        (Grammar("json_schema", "{not json"), "invalid json_schema"),
        (Grammar("json_schema", "[1, 2]"), "object or a boolean"),
        (Grammar("json_schema", '{"type": "string", "format": "no-such"}'), "no-such"),
        (Grammar("ebnf", "root ::= missing"), "missing"),
        (Grammar("lark", "start: ("), "Expected token ')'"),
        (Grammar("cobol", "x"), "grammar kind"),
        (Grammar("lark", "start: " + " | ".join(f'"o{i}"' for i in range(3000))), "max is 2000"),
    ],
)
async def test_bad_grammars_are_refused_with_one_line(engine, grammar, message):
    with pytest.raises(GrammarError, match=re.escape(message)) as refused:
        await engine.structured_outputs.check(grammar, 10.0)
    assert "\n" not in str(refused.value)


def test_digits_are_ascii():
    assert ascii_digits(r"\d{4}-[\d.]+") == "[0-9]{4}-[0-9.]+"
    assert ascii_digits(r"\\d \D []\d] [^]\d]") == r"\\d \D []0-9] [^]0-9]"


async def test_mlx_engine_holds_grammars(model_dir):
    pytest.importorskip("mlx_lm")
    from backends.mlx.engine import MlxEngine

    engine = await asyncio.to_thread(MlxEngine.load, EngineConfig(model=str(model_dir), dtype="float32"))
    try:
        ids = chat_ids(engine.info.tokenizer, "Describe a person you know as a JSON object.")
        person, date = await asyncio.gather(
            generate(engine, ids, PERSON, max_tokens=64),
            generate(engine, chat_ids(engine.info.tokenizer, REGEXES["date"][1]), DATE),
        )
        jsonschema.validate(json.loads(text_of(engine, person)), SCHEMAS[3])
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text_of(engine, date))
    finally:
        await engine.aclose()
