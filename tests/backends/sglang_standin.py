"""A stand-in for `python -m sglang.launch_server`: SGLang's native HTTP API on a deterministic fake
model, for tests where SGLang itself cannot run (it needs CUDA).

It takes launch_server's options, answers /health, /server_info, /generate (plain and `stream`),
/load_lora_adapter and /unload_lora_adapter, and replays the response shapes in sglang_recordings/
with values computed from `distribution()`, which tests import to know the right answer. Unless
--no-validate is given, every /generate body is built into a real sglang `GenerateReqInput` (and its
`sampling_params` into a real `SamplingParams`), so a misspelled or removed field fails the request
as it would in SGLang's Python API; the HTTP server itself would silently ignore it.

New weights (sglang_standin_weights.py): /update_weights_from_disk, /init_weights_update_group,
/update_weights_from_distributed and /destroy_weights_update_group, as SGLang 0.5.17 answers them,
their bodies checked against sglang's own request types; the model's distribution then depends on
the weights it has (`weights_version`).

--behaviour crash | never-healthy | ignore-term drives the managed-server lifecycle tests.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import os
import signal
import sys
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

try:  # run as a script, this directory is on the path; imported by tests, the repository
    from sglang_standin_weights import WEIGHTS_PATHS, Weights
except ImportError:
    from tests.backends.sglang_standin_weights import WEIGHTS_PATHS, Weights

RECORDINGS = Path(__file__).parent / "sglang_recordings"


def distribution(prefix, adapter, vocab_size, weights=""):
    """The fake model: log-probabilities after `prefix` (float32 [vocab_size]) with the weights
    `weights` ("": those it started with; see sglang_standin_weights.weights_version)."""
    key = json.dumps([list(map(int, prefix)), adapter, *([weights] if weights else [])]).encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    logits = np.random.default_rng(seed).standard_normal(vocab_size) * 3
    return (logits - np.logaddexp.reduce(logits)).astype(np.float32)  # normalised in float64


def _serving_fields(meta, first, last):
    """meta_info fields of SGLang 0.5.17's answers that carry no result; a stream has the time sent
    in its first chunk only, and the latency in its last."""
    meta["dp_rank"] = None
    meta.pop("e2e_latency", None)
    if first:
        meta["response_sent_to_client_ts"] = time.time()
    if last:
        meta["e2e_latency"] = 0.0123


def _top(dist, k):
    ids = np.argsort(-dist, kind="stable")[:k]
    return dist[ids], ids


def _load_sglang_types():
    """sglang's request types without its CUDA-only imports: this environment has no torchvision
    (its wheels pin another torch) and a newer transformers than sglang 0.5.17 pins, which already
    registers some of the configs sglang registers. Only this stand-in process is patched."""
    import functools
    import importlib.abc
    import importlib.machinery

    import transformers.image_processing_base  # noqa: F401 (fixes transformers' torchvision check first)
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    class Anything(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {"__init__": lambda self, *a, **k: None})

    class TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torchvision":
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = Anything(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            pass

    try:
        import torchvision  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, TorchvisionStub())
    for auto in (AutoConfig, AutoProcessor, AutoTokenizer, AutoImageProcessor):
        auto.register = functools.partial(auto.register, exist_ok=True)
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    return GenerateReqInput, SamplingParams


class _NoStopStrings:
    """A tokenizer for SGLang's checks that need one: the engine sends stop token ids, never
    stop strings, so nothing is ever encoded."""

    def encode(self, *_args, **_kwargs):
        raise AssertionError("the engine sends no stop strings to SGLang")


_NO_STOP_STRINGS = _NoStopStrings()


class Model:
    def __init__(self, args):
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.context_length = args.context_length or 2048
        self.incremental = args.incremental_streaming_output
        self.stream_interval = args.stream_interval
        self.adapters = set()
        self.custom_logit_processor = args.enable_custom_logit_processor
        self.requests = []  # every /generate body, for tests of what the engine sent
        self.kept = set()  # prefixes answered before, as SGLang's radix cache keeps them
        self.types = None if args.no_validate else _load_sglang_types()
        self.weights = Weights(Path(args.model_path), validate=not args.no_validate)

    def validate(self, body):
        if self.types is None:
            return
        request_class, sampling_class = self.types
        request = request_class(**body)  # TypeError on a field GenerateReqInput does not have
        request.normalize_batch_and_arguments()
        sampling = sampling_class(**(body.get("sampling_params") or {}))
        # a server with its tokenizer (the engine never skips it), which only stop strings would use
        sampling.normalize(_NO_STOP_STRINGS)
        sampling.verify(self.vocab_size)

    def check(self, body):
        """SGLang's refusals: a 400 with the message, as its server answers them."""
        ids = body["input_ids"]
        if len(ids) > self.context_length:
            return f"The input ({len(ids)} tokens) is longer than the model's context length ({self.context_length} tokens)."
        if body.get("custom_logit_processor") and not self.custom_logit_processor:
            return (
                "The server is not configured to enable custom logit processor. "
                "Please set `--enable-custom-logit-processor` to enable this feature."
            )
        lora = body.get("lora_path")
        if lora is not None and lora not in self.adapters:
            return f"The following requested LoRA adapters are not loaded: {lora}"
        return None

    def prompt_meta(self, body):
        """input_token_logprobs and the flat top logprobs from logprob_start_len on."""
        ids, lora = body["input_ids"], body.get("lora_path")
        start = body.get("logprob_start_len", -1)
        start = len(ids) if start is None or start < 0 else start
        k = body.get("top_logprobs_num") or 0
        dists = [
            distribution(ids[:p], lora, self.vocab_size, self.weights.version)
            for p in range(start + 1, len(ids))
        ]
        token_logprobs = [[None, ids[start], None]] if start < len(ids) else []
        token_logprobs += [[float(d[t]), t, None] for d, t in zip(dists, ids[start + 1 :], strict=True)]
        meta = {"input_token_logprobs": token_logprobs}
        if k:
            tops = [_top(d, k) for d in dists]
            values = np.array([v for v, _ in tops], np.float32).reshape(len(tops), k)
            top_ids = np.array([i for _, i in tops], np.int32).reshape(len(tops), k)
            if body.get("return_flat_raw_top_logprobs_b64"):
                meta["input_top_logprobs_val_flat_b64"] = base64.b64encode(values.tobytes()).decode()
                meta["input_top_logprobs_idx_flat_b64"] = base64.b64encode(top_ids.tobytes()).decode()
                meta["input_top_logprobs_val_flat_b64_dtype"] = "float32"
                meta["input_top_logprobs_idx_flat_b64_dtype"] = "int32"
                meta["input_top_logprobs_shape"] = [len(tops), k]
                meta["input_top_logprobs_null_prefix"] = 1 if start < len(ids) else 0
            else:
                rows = [[[float(v), int(i), None] for v, i in zip(*t, strict=True)] for t in tops]
                meta["input_top_logprobs"] = ([None] if start < len(ids) else []) + rows
        return meta

    def cached(self, body):
        """SGLang's cached-token fields: the longest prefix kept from an earlier request, never the
        whole input nor past the first position whose logprobs are asked; the details only when
        something was cached."""
        ids = tuple(body["input_ids"])
        start = body.get("logprob_start_len", -1) if body.get("return_logprob") else -1
        limit = min(len(ids) - 1, start) if start is not None and start >= 0 else len(ids) - 1
        n = max((k for k in range(1, limit + 1) if ids[:k] in self.kept), default=0)
        self.kept.update(ids[:k] for k in range(1, len(ids) + 1))
        return {"cached_tokens": n, "cached_tokens_details": {"device": n, "host": 0} if n else None}

    def answer(self, body):
        """The non-streamed answer: the final chunk of generation, with the time sent."""
        out = list(self.chunks(body, incremental=False))[-1]
        meta = out["meta_info"]
        meta["response_sent_to_client_ts"] = time.time()
        if not body.get("return_logprob"):
            for key in [k for k in meta if "logprobs" in k]:
                del meta[key]
        if body.get("custom_logit_processor"):
            meta.update(self.processed(body))
        return out

    def processed(self, body):
        """What the request's custom logit processor puts in meta_info: it is unpickled as SGLang's
        scheduler does (by reference: it must be importable here) and called with the logits of the
        request's prompt position, once, as SGLang's sampler calls it for the first output token."""
        import dill
        import torch

        processor = dill.loads(bytes.fromhex(json.loads(body["custom_logit_processor"])["callable"]))()
        request = types.SimpleNamespace(customized_info=None)
        params = {**body["sampling_params"]["custom_params"], "__req__": request}
        logits = torch.from_numpy(
            distribution(body["input_ids"], body.get("lora_path"), self.vocab_size, self.weights.version)
        )
        processor(logits[None].clone(), [params])
        return request.customized_info or {}

    def chunks(self, body, incremental):
        shape = json.loads((RECORDINGS / "generate.json").read_text())
        sampling = body.get("sampling_params") or {}
        limit = sampling.get("max_new_tokens", 128)
        stops = set(sampling.get("stop_token_ids") or [])
        k = body.get("top_logprobs_num") or 0
        interval = sampling.get("stream_interval") or self.stream_interval
        ids, lora = list(body["input_ids"]), body.get("lora_path")
        outputs, tops, finish, sent = [], [], None, 0
        cache = self.cached(body)  # what SGLang's radix cache held when the request came in
        if limit == 0:
            finish = {"type": "length", "length": 0}
        while finish is None:
            dist = distribution(ids, lora, self.vocab_size, self.weights.version)
            token = int(np.argmax(dist))
            ids.append(token)
            outputs.append([float(dist[token]), token, None])
            tops.append([[float(v), int(i), None] for v, i in zip(*_top(dist, k), strict=True)])
            if token in stops:
                finish = {"type": "stop", "matched": token}
            elif len(outputs) == limit:
                finish = {"type": "length", "length": limit}
            # SGLang's scheduler sends a streamed request's tokens at the first and then every
            # `interval`-th token (its output streamer), and at its finish.
            if finish is None and interval > 1 and len(outputs) % interval != 1:
                continue
            out = copy.deepcopy(shape)
            meta = out["meta_info"]
            for key in [k for k in meta if "logprobs" in k]:
                del meta[key]
            meta.update(self.prompt_meta(body))
            start, first = (sent if incremental else 0), sent == 0
            sent = len(outputs)
            meta.update(
                finish_reason=finish,
                prompt_tokens=len(body["input_ids"]),
                completion_tokens=len(outputs),
                output_token_logprobs=outputs[start:],
                output_token_logprobs_length=len(outputs),
                **cache,
            )
            _serving_fields(meta, first=first, last=finish is not None)
            if k:
                meta["output_top_logprobs"] = tops[start:]
            if not body.get("return_logprob"):
                for key in [k for k in meta if "logprobs" in k]:
                    del meta[key]
            out["output_ids"] = [t for _, t, _ in outputs[start:]]
            yield out
        if limit == 0:
            out = copy.deepcopy(shape)
            meta = out["meta_info"]
            for key in [k for k in meta if "logprobs" in k]:
                del meta[key]
            meta.update(self.prompt_meta(body), output_token_logprobs=[], prompt_tokens=len(ids))
            meta.update(output_token_logprobs_length=0, **cache)
            _serving_fields(meta, first=True, last=True)
            if k:  # SGLang also reports the distribution after the whole input, as triples
                meta["output_top_logprobs"] = [
                    [
                        [float(v), int(i), None]
                        for v, i in zip(
                            *_top(distribution(ids, lora, self.vocab_size, self.weights.version), k),
                            strict=True,
                        )
                    ]
                ]
            yield out


def make_handler(model, args):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, so the client's pool is exercised

        def log_message(self, fmt, *a):
            print(fmt % a, flush=True)

        def _json(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                if args.behaviour == "never-healthy":
                    return self._json(503, {})
                return self._json(200, {})
            if self.path == "/server_info":
                env = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_")}
                return self._json(200, {"argv": sys.argv[1:], "env": env})
            if self.path == "/standin/requests":
                return self._json(200, model.requests)
            if self.path == "/standin/weights":  # the weights_version distribution() is given now
                return self._json(200, {"version": model.weights.version})
            self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path in ("/load_lora_adapter", "/unload_lora_adapter"):
                return self._lora(body)
            if self.path in WEIGHTS_PATHS:
                model.requests.append({"path": self.path, **body})
                return self._json(*model.weights.answer(self.path, body))
            if self.path != "/generate":
                model.requests.append({"path": self.path})  # what SGLang was asked and lacks
                return self._json(404, {"detail": "Not Found"})
            model.requests.append(body)
            with model.weights.serving():
                return self._generate(body)

        def _generate(self, body):
            try:
                model.validate(body)
            except (TypeError, ValueError) as exc:
                return self._json(400, {"error": {"message": f"{type(exc).__name__}: {exc}"}})
            refusal = model.check(body)
            if not body.get("stream"):
                if refusal:
                    error = json.loads((RECORDINGS / "error.json").read_text())
                    error["error"]["message"] = refusal
                    return self._json(400, error)
                return self._json(200, model.answer(body))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            if refusal:  # SGLang streams a 400-status abort as a final chunk
                abort = {"type": "abort", "message": refusal, "status_code": 400, "err_type": None}
                events = [{"text": "", "output_ids": [], "meta_info": {"finish_reason": abort}}]
            else:
                events = model.chunks(body, model.incremental)
            try:
                for out in events:
                    self.wfile.write(b"data: " + json.dumps(out).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped early
            self.close_connection = True

        def _lora(self, body):
            answer = json.loads((RECORDINGS / "lora_update.json").read_text())
            name = body["lora_name"]
            if self.path == "/load_lora_adapter":
                if not Path(body["lora_path"]).is_dir():
                    answer.update(success=False, error_message=f"no adapter at {body['lora_path']}")
                else:
                    model.adapters.add(name)
            elif name in model.adapters:
                model.adapters.discard(name)
            else:
                answer.update(success=False, error_message=f"LoRA adapter {name} is not loaded")
            answer["loaded_adapters"] = dict.fromkeys(sorted(model.adapters), "")
            self._json(200 if answer["success"] else 400, answer)

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--stream-interval", type=int, default=1)  # tokens per streamed chunk
    parser.add_argument("--enable-custom-logit-processor", action="store_true")
    parser.add_argument("--no-validate", action="store_true")
    parser.add_argument("--behaviour", default="ok", choices=["ok", "crash", "never-healthy", "ignore-term"])
    args, _ = parser.parse_known_args()  # launch_server's other options (dtype, LoRA, ...) are accepted
    print("stand-in sglang server starting", flush=True)
    if args.behaviour == "crash":
        print("RuntimeError: CUDA error: no kernel image is available (stand-in crash)", flush=True)
        sys.exit(3)
    if args.behaviour == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    model = Model(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(model, args))
    server.daemon_threads = True
    print(f"serving on {args.host}:{args.port}", flush=True)
    if args.behaviour != "ignore-term":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


if __name__ == "__main__":
    main()
