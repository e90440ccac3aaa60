"""SGLang's native API on the real model (float32 on the CPU): /generate compared token for token
with /v1/completions and number for number with a direct forward pass, and SGLang's own frontend
language (`sgl.RuntimeEndpoint`) running programs against the gateway."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import httpx
import jsonschema
import numpy as np
import pytest

from tests.conftest import MODEL, dense_rows, mock_app_client

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def generate(http, **body):
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def completion_ids(http, prompt, max_tokens):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    return choice["text"]


def test_greedy_text_and_ids_equal_completions_and_a_forward_pass(http, reference):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    expected = reference.greedy(ids, 8)
    sampling = {"max_new_tokens": 8, "temperature": 0}
    from_text = generate(http, text=PROMPT, sampling_params=sampling, return_logprob=True)
    from_ids = generate(http, input_ids=ids, sampling_params=sampling, return_logprob=True)
    for out in (from_text, from_ids):
        assert out["output_ids"] == expected
        assert out["text"] == completion_ids(http, ids, 8)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 8
        assert meta["finish_reason"] == {"type": "length", "length": 8}
        assert meta["input_token_logprobs"] == []  # logprob_start_len -1: none, as SGLang
        rows = reference.logprobs(ids + expected)
        lps = [t[0] for t in meta["output_token_logprobs"]]
        want = [rows[len(ids) - 1 + i, tok] for i, tok in enumerate(expected)]
        assert [t[1] for t in meta["output_token_logprobs"]] == expected
        np.testing.assert_allclose(lps, want, atol=1e-4)


def test_input_logprobs_from_a_start_with_top_logprobs_and_text(http, reference):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    out = generate(
        http,
        input_ids=ids,
        sampling_params={"max_new_tokens": 0, "temperature": 0},
        return_logprob=True,
        logprob_start_len=2,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    assert out["text"] == "" and out["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    rows = reference.logprobs(ids)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[2:]
    assert entries[0][0] is None  # the first entry has no logprob, even past position 0
    assert [e[2] for e in entries] == [reference.tokenizer.decode([i]) for i in ids[2:]]
    np.testing.assert_allclose(
        [e[0] for e in entries[1:]], [rows[p - 1, ids[p]] for p in range(3, len(ids))], atol=1e-4
    )
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(entries)
    for p, top in zip(range(3, len(ids)), tops[1:], strict=True):
        assert [t[1] for t in top] == list(np.argsort(-rows[p - 1])[:3])
        np.testing.assert_allclose([t[0] for t in top], np.sort(rows[p - 1])[::-1][:3], atol=1e-4)
    # the would-be next token: one triple, drawn with the request's sampling (greedy: the most likely)
    (next_lp, next_id, next_text) = meta["output_token_logprobs"][0]
    assert next_id == int(np.argmax(rows[-1])) and abs(next_lp - rows[-1].max()) < 1e-4
    assert next_text == reference.tokenizer.decode([next_id])
    assert len(meta["output_top_logprobs"]) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_logprob_reads_the_named_ids_at_every_position(http, reference, stream):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    expected = reference.greedy(ids, 3)
    wanted = [expected[0], 13, 330]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 3,
        "token_ids_logprob": wanted,
        "stream": stream,
    }
    response = http.post("/generate", json=body)
    text = response.text
    last = text.split("\n\n")[-3][len("data: ") :] if stream else text
    meta = json.loads(last)["meta_info"]
    rows = reference.logprobs(ids + expected)
    assert meta["input_token_ids_logprobs"][0] is None
    assert len(meta["input_token_ids_logprobs"]) == len(ids) - 3
    for p, entry in zip(range(4, len(ids)), meta["input_token_ids_logprobs"][1:], strict=True):
        assert [t[1] for t in entry] == wanted
        np.testing.assert_allclose([t[0] for t in entry], rows[p - 1, wanted], atol=1e-4)
    assert len(meta["output_token_ids_logprobs"]) == 3
    for i, entry in enumerate(meta["output_token_ids_logprobs"]):
        np.testing.assert_allclose([t[0] for t in entry], rows[len(ids) - 1 + i, wanted], atol=1e-4)


def test_token_ids_logprob_rows_go_through_the_output_cache_and_the_engine(http, gateway, reference):
    """/generate reads whole rows where /v1/next_token_logprobs does: its rows reach the engine
    once, the same request again is answered from the output cache, and so are dense requests for
    the same prefixes, with the very numbers of the direct forward pass."""
    ids = reference.tokenizer("Rows of a generate request, read once and cached:")["input_ids"]
    expected = reference.greedy(ids, 2)
    wanted = [expected[0], 13, 330]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob": wanted,
    }
    # the row after each proper prefix of the prompt (scores of positions 1 .. P-1), then one per token
    prefixes = [ids[:p] for p in range(1, len(ids))] + [ids, ids + expected[:1]]

    def engine_rows() -> int:
        return http.get(f"/v1/models/{MODEL}/stats").json()["rows"]

    before = engine_rows()
    first = generate(http, **body)
    assert engine_rows() - before == len(prefixes)  # every row was new to the cache
    again = generate(http, **body)
    assert engine_rows() - before == len(prefixes)  # none reached the engine again
    assert again["meta_info"]["input_token_ids_logprobs"] == first["meta_info"]["input_token_ids_logprobs"]
    assert again["meta_info"]["output_token_ids_logprobs"] == first["meta_info"]["output_token_ids_logprobs"]

    matrix, hits = dense_rows(gateway.base_url, prefixes)
    assert hits == len(prefixes) and engine_rows() - before == len(prefixes)
    meta = first["meta_info"]
    assert first["output_ids"] == expected and meta["input_token_ids_logprobs"][0] is None
    entries = meta["input_token_ids_logprobs"][1:] + meta["output_token_ids_logprobs"]
    assert len(entries) == len(prefixes)
    got = np.array([[t[0] for t in entry] for entry in entries], dtype=np.float32)
    assert all([t[1] for t in entry] == wanted for entry in entries)
    np.testing.assert_array_equal(got, matrix[:, wanted])  # the cached rows, bit for bit
    rows = reference.logprobs(ids + expected)
    np.testing.assert_allclose(got, rows[: len(prefixes), wanted], atol=1e-4)
    np.testing.assert_allclose(matrix, rows[: len(prefixes)], atol=1e-4)


def test_more_rows_than_one_engine_batch_keep_their_order():
    """A prompt of more positions than the model's max_batch_rows: /generate asks its rows batch
    after batch, in order, and a dense request for the same prefixes gets them all from the cache."""
    import msgspec

    with mock_app_client() as (app, client):
        max_batch_rows = app.state.registry.models["mock"].settings.max_batch_rows
        ids = [(7 * i) % 1000 + 1 for i in range(max_batch_rows + 44)]
        wanted = [3, 5]
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "token_ids_logprob": wanted,
        }
        response = client.post("/generate", json=body)
        assert response.status_code == 200, response.text
        meta = response.json()["meta_info"]
        entries = meta["input_token_ids_logprobs"][1:] + meta["output_token_ids_logprobs"]
        prefixes = [ids[:p] for p in range(1, len(ids) + 1)]  # then the row after the whole prompt
        assert len(entries) == len(prefixes)
        stats = client.get("/v1/models/mock/stats").json()
        assert stats["rows"] == len(prefixes) and stats["engine_calls"] >= 2
        assert stats["largest_call"] <= max_batch_rows and "engine_passes" not in stats
        dense = client.post(
            "/v1/next_token_logprobs",
            json={"model": "mock", "input": prefixes, "layout": "matrix"},
            headers={"Accept": "application/msgpack"},
        )
        assert dense.status_code == 200, dense.text
        document = msgspec.msgpack.decode(dense.content)
        assert document["usage"]["cache_hits"] == len(prefixes)
        matrix = np.frombuffer(document["logprobs"], "<f4").reshape(len(prefixes), -1)
        got = np.array([[t[0] for t in entry] for entry in entries], dtype=np.float32)
        np.testing.assert_array_equal(got, matrix[:, wanted])


def test_sampled_tokens_report_logprobs_at_the_temperature(http, reference):
    """As SGLang: log_softmax(logits / temperature) of each sampled token, and of its top-k."""
    ids = reference.tokenizer(PROMPT)["input_ids"]
    out = generate(
        http,
        input_ids=ids,
        sampling_params={"max_new_tokens": 4, "temperature": 0.5, "sampling_seed": 7},
        return_logprob=True,
        top_logprobs_num=2,
        token_ids_logprob=[13],
    )
    meta = out["meta_info"]
    logits = reference.logprobs(ids + out["output_ids"]).astype(np.float64) / 0.5
    scaled = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    for i, (token, entry) in enumerate(zip(out["output_ids"], meta["output_token_logprobs"], strict=True)):
        row = scaled[len(ids) - 1 + i]
        assert entry[1] == token and abs(entry[0] - row[token]) < 1e-4
        top = meta["output_top_logprobs"][i]
        assert [t[1] for t in top] == list(np.argsort(-row)[:2])
        assert abs(meta["output_token_ids_logprobs"][i][0][0] - row[13]) < 1e-4


def test_batch_and_n_answer_a_list_prompt_major(http, reference):
    prompts = [PROMPT, "One, two, three,"]
    out = http.post(
        "/generate",
        json={
            "text": prompts,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 2},
            "rid": "r",
        },
    ).json()
    assert isinstance(out, list) and len(out) == 4
    for i, prompt in enumerate(prompts):
        ids = reference.tokenizer(prompt)["input_ids"]
        expected = reference.greedy(ids, 3)
        assert out[2 * i]["output_ids"] == out[2 * i + 1]["output_ids"] == expected
        assert out[2 * i]["meta_info"]["id"].startswith(f"r_{i}_")


def test_stop_string_cuts_text_but_keeps_the_ids(http, reference):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    expected = reference.greedy(ids, 8)
    full = reference.tokenizer.decode(expected)
    stop = full.strip().split()[1]  # the second word of the greedy continuation
    out = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0, "stop": stop})
    assert out["text"] == full[: full.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # the ids run through the token that completed the stop string, none after it
    through = next(k for k in range(1, 9) if stop in reference.tokenizer.decode(expected[:k]))
    assert out["output_ids"] == expected[:through]
    kept = generate(
        http,
        text=PROMPT,
        sampling_params={"max_new_tokens": 8, "temperature": 0, "stop": stop, "no_stop_trim": True},
    )
    assert kept["text"] == out["text"] + stop


def test_stop_token_ids_end_generation_with_the_id(http, reference):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    expected = reference.greedy(ids, 6)
    out = generate(
        http,
        input_ids=ids,
        sampling_params={"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [expected[2]]},
    )
    assert out["output_ids"] == expected[: expected.index(expected[2]) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": expected[2]}


def test_stream_is_cumulative_and_ends_with_done(http, reference):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    expected = reference.greedy(ids, 6)
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "stream": True,
        "return_logprob": True,
    }
    with http.stream("POST", "/generate", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-2]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last["output_ids"] == expected and last["text"] == reference.tokenizer.decode(expected)
    assert len(last["meta_info"]["output_token_logprobs"]) == 6 and "e2e_latency" in last["meta_info"]


def test_info_and_health_endpoints(http, model_dir):
    for path in ("/model_info", "/get_model_info"):
        info = http.get(path).json()
        assert info["model_path"] == str(model_dir) and info["is_generation"] is True
        assert info["model_type"] == "llama"
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert (info["tp_size"], info["dp_size"]) == (1, 1) and info["context_length"] == 8192
    assert http.get("/health_generate").status_code == 200
    assert http.get("/model_info", params={"model": "nope"}).status_code == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "text"),
        ({"text": ""}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, "a"]}, "input_ids"),
        ({"input_ids": [49152]}, "input_ids"),
        ({"text": "a", "sampling_params": {"regex": "(?<=a)b"}}, "sampling_params.regex"),
        (
            {"text": "a", "sampling_params": {"json_schema": '{"type": "strin"}'}},
            "sampling_params.json_schema",
        ),
        ({"text": "a", "sampling_params": {"ebnf": "root ::= missing"}}, "sampling_params.ebnf"),
        ({"text": "a", "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"text": "a", "sampling_params": {"min_p": 1.5}}, "sampling_params.min_p"),
        ({"text": "a", "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
        ({"text": "a", "sampling_params": {"stop_token_ids": [49152]}}, "sampling_params.stop_token_ids"),
        ({"text": "a", "sampling_params": {"unknown": 1}}, "sampling_params"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "a", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "a", "lora_path": "missing"}, "model"),
        ({"text": "a", "return_logprob": True, "token_ids_logprob": [49152]}, "token_ids_logprob"),
        ({"text": ["a", "b"], "token_ids_logprob": [[1], [2], [3]]}, "token_ids_logprob"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens"),
    ],
)
def test_bad_input_is_a_4xx_with_the_error_object(http, body, param):
    response = http.post("/generate", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param


def test_routes_are_counted_and_behind_keys():
    with mock_app_client() as (app, client):
        assert (
            client.post(
                "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            ).status_code
            == 200
        )
        metrics = client.get("/metrics").text
        assert 'route="/generate"' in metrics
        assert (
            'logprob_gateway_generation_tokens_total{adapter="",endpoint="generate",model="mock"} 2.0'
            in metrics
        )


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FRONTEND = textwrap.dedent(
    """
    import functools, importlib.abc, importlib.machinery, json, sys, types
    import transformers.image_processing_base  # transformers' own torchvision check first

    class Anything(types.ModuleType):  # sglang's package imports torchvision; the frontend never uses it
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {"__init__": lambda self, *a, **k: None})

    class Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torchvision":
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
        def create_module(self, spec):
            module = Anything(spec.name); module.__path__ = []; return module
        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Stub())
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer
    for auto in (AutoConfig, AutoProcessor, AutoTokenizer, AutoImageProcessor):
        auto.register = functools.partial(auto.register, exist_ok=True)
    import sglang as sgl

    sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
    PERSON = json.loads(sys.argv[2])

    @sgl.function
    def program(s, choices):
        s += "Q: What is the capital of France?\\nA:"
        s += sgl.gen("answer", max_tokens=12, temperature=0, stop="\\n")
        s += "\\nThe best city is"
        s += sgl.select("city", choices=choices)
        forks = s.fork(2)
        for f, word in zip(forks, [" Yes", " No"]):
            f += word + "," + sgl.gen("more", max_tokens=4, temperature=0)
        s["more"] = [f["more"] for f in forks]

    state = program.run(choices=[" Paris", " Berlin", " a banana"])
    out = {"text": state.text(), "answer": state["answer"], "city": state["city"],
           "more": state["more"], "select": state.get_meta_info("city")}

    @sgl.function
    def constrained(s, schema):
        s += "1 + 1 = " + sgl.gen_int("n", max_tokens=3)
        s += "\\nThe date: " + sgl.gen("date", max_tokens=16, temperature=0, regex=r"\\d{4}-\\d{2}-\\d{2}")
        s += "\\nA person: " + sgl.gen("person", max_tokens=48, temperature=0, json_schema=schema)

    held = constrained.run(schema=json.dumps(PERSON))
    held.sync()
    out["error"] = str(held.error())
    out.update(n=held["n"], date=held["date"], person=held["person"])
    print(json.dumps(out))
    """
)


def test_sglang_frontend_runs_gen_select_and_fork(gateway, reference):
    assert_frontend_program(gateway.base_url, reference, atol=1e-4)


def assert_frontend_program(base_url: str, reference, atol: float) -> None:
    """The frontend's program against `base_url`: its gen, select and fork equal a forward pass
    (select's normalized scores within `atol`)."""
    result = subprocess.run(
        [sys.executable, "-c", FRONTEND, base_url, json.dumps(PERSON)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    prefix = "Q: What is the capital of France?\nA:"
    tok = reference.tokenizer
    ids = tok(prefix)["input_ids"]
    greedy = tok.decode(reference.greedy(ids, 12))
    assert out["answer"] == greedy.split("\n")[0]
    # select: the choice a direct forward pass scores highest, as the frontend normalizes it
    context = prefix + out["answer"] + "\nThe best city is"
    start = max(len(tok(context)["input_ids"]) - 2, 0)
    scores = []
    for choice in [" Paris", " Berlin", " a banana"]:
        full = tok(context + choice)["input_ids"]
        rows = reference.logprobs(full)
        values = [rows[p - 1, full[p]] for p in range(start + 1, len(full))]
        scores.append(sum(values) / len(values))
    np.testing.assert_allclose(out["select"]["normalized_prompt_logprobs"], scores, atol=atol)
    assert out["city"] == [" Paris", " Berlin", " a banana"][int(np.argmax(scores))]
    # fork: each branch continues greedily from its own text
    for word, more in zip([" Yes", " No"], out["more"], strict=True):
        branch = tok(context + out["city"] + word + ",")["input_ids"]
        assert more == tok.decode(reference.greedy(branch, 4))
    # constrained: gen_int, gen(regex=...) and gen(json_schema=...) hold to their grammars
    assert out["error"] == "None"
    assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", out["n"]), out["n"]
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", out["date"]), out["date"]
    jsonschema.validate(json.loads(out["person"]), PERSON)


def test_torchrl_async_sglang_generates_against_the_gateway(gateway, reference):
    assert_torchrl_generates(gateway.base_url, reference, atol=1e-4)


def assert_torchrl_generates(base_url: str, reference, atol: float) -> None:
    pytest.importorskip("torchrl", reason="TorchRL is installed by .ci/run (--no-deps)")
    from torchrl.modules.llm.backends.sglang import AsyncSGLang

    engine = AsyncSGLang(server_url=base_url)
    ids = reference.tokenizer(PROMPT)["input_ids"]
    expected = reference.greedy(ids, 5)
    params = {"max_new_tokens": 5, "temperature": 0.0}
    for out in (
        engine.generate(PROMPT, params, return_logprobs=True),
        engine.generate(input_ids=ids, sampling_params=params, return_logprobs=True),
    ):
        assert out["output_ids"] == expected
        rows = reference.logprobs(ids + expected)
        want = [rows[len(ids) - 1 + i, tok] for i, tok in enumerate(expected)]
        np.testing.assert_allclose([t[0] for t in out["meta_info"]["output_token_logprobs"]], want, atol=atol)


def test_batch_stream_events_carry_their_index(http, reference):
    prompts = [PROMPT, "One, two, three,"]
    body = {"text": prompts, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "stream": True}
    with http.stream("POST", "/generate", json=body) as response:
        raw = b"".join(response.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    finals = {}
    for event in events[:-2]:
        chunk = json.loads(event[len(b"data: ") :])
        if chunk["meta_info"]["finish_reason"] is not None:
            finals[chunk["index"]] = chunk["output_ids"]
    assert finals == {
        i: reference.greedy(reference.tokenizer(p)["input_ids"], 3) for i, p in enumerate(prompts)
    }


def test_lora_path_and_model_select_the_adapter(lora_gateway, lora_adapters, model_dir, reference):
    """On the session's admin gateway (tests/conftest.py), adapter "a" loaded at start."""
    import httpx

    from tests.conftest import last_row, load_peft_models

    gateway, path = lora_gateway, lora_adapters[1]["a"]
    peft = load_peft_models(model_dir, {"a": path})["a"]
    ids = reference.tokenizer(PROMPT)["input_ids"]
    expected, sequence = [], list(ids)
    for _ in range(4):  # the adapter's greedy continuation, by direct forward passes
        expected.append(int(np.argmax(last_row(peft, sequence))))
        sequence.append(expected[-1])
    assert expected != reference.greedy(ids, 4)  # the adapter changes the output
    sampling = {"max_new_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=gateway.base_url, timeout=120) as http:
        by_lora = generate(http, input_ids=ids, sampling_params=sampling, lora_path="a", return_logprob=True)
        by_model = generate(http, input_ids=ids, sampling_params=sampling, model=f"{MODEL}:a")
        batch = http.post(
            "/generate", json={"input_ids": [ids, ids], "sampling_params": sampling, "lora_path": ["a", None]}
        ).json()
    assert by_lora["output_ids"] == by_model["output_ids"] == batch[0]["output_ids"] == expected
    assert batch[1]["output_ids"] == reference.greedy(ids, 4)
    rows = [last_row(peft, ids + expected[:i]) for i in range(4)]
    lps = [t[0] for t in by_lora["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(lps, [row[t] for row, t in zip(rows, expected, strict=True)], atol=1e-4)


@pytest.fixture(scope="module", params=["composed-vllm", "mlx"])
def other_engine(request):
    """A gateway on another engine: (base URL, the tolerance of its rows against transformers).
    vLLM's: the session's composed model (tests/conftest.py), vLLM generating and the transformers
    engine scoring, so one vLLM start serves both modules; MLX's: the session's MLX gateway, which
    tests/backends/test_mlx_engine.py uses too."""
    if request.param == "composed-vllm":
        return request.getfixturevalue("composed_vllm_starting").result().base_url, 1e-2
    return request.getfixturevalue("mlx_gateway").base_url, 1e-3


def test_sglang_clients_work_the_same_on_vllm_and_mlx(other_engine, reference):
    base_url, atol = other_engine
    ids = reference.tokenizer(PROMPT)["input_ids"]
    expected = reference.greedy(ids, 8)
    with httpx.Client(base_url=base_url, timeout=120) as http:
        out = generate(
            http, input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0}, return_logprob=True
        )
        assert out["output_ids"] == expected and out["text"] == completion_ids(http, ids, 8)
        rows = reference.logprobs(ids + expected)
        want = [rows[len(ids) - 1 + i, tok] for i, tok in enumerate(expected)]
        np.testing.assert_allclose([t[0] for t in out["meta_info"]["output_token_logprobs"]], want, atol=atol)
    assert_frontend_program(base_url, reference, atol)
    assert_torchrl_generates(base_url, reference, atol)
