"""Dense rows from SGLang's own Scheduler driven in this process, against the transformers engine.

    python -m bench.sglang_scheduler --random-model llama-1b --device cuda --dtype bfloat16 \
        --tokenizer DIR --particles 64 256 --steps 8 --repeats 3     # on a GPU machine with sglang

The way genlm-backend's `AsyncSGLTransformer` takes rows from SGLang, on sglang 0.5.17: no tokenizer
manager, no ZMQ, no detokenizer. Each row is a prefill-only request (`max_new_tokens` = 0) handed to
`Scheduler.process_input_requests`; the scheduler's own batching and radix cache run it, and the row
is the log_softmax of `logits_output.next_token_logits` (whole rows, on the GPU, one copy to the
host per batch). The workload is bench/sglang_rows.py's: P particles on a shared 32-token prompt,
each appending a seeded random token per step.

Prints rows/s per P beside the transformers engine, the largest |difference| of the rows, and where
a step's time goes inside the scheduler (ms per step: submit, schedule, forward, rows to host,
result processing). `--profile` adds cProfile's top functions for the last P.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import tempfile
import time
from array import array
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from backends.transformers.engine import TransformersEngine, resolve_device, resolve_dtype
from backends.types import EngineConfig
from bench.sglang_rows import add_compare_arguments, compare, run_way
from bench.smc import random_model_dir
from bench.smc_ways import SGLANG_ARGS


class SchedulerRows:
    """SGLang's Scheduler in this process, answering batches of rows."""

    def __init__(self, model_dir: Path, dtype: str, **server_args) -> None:
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.runtime_context import publish
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.server_args import PortArgs, ServerArgs

        args = ServerArgs(
            model_path=str(model_dir),
            dtype=dtype,
            skip_tokenizer_init=True,
            disable_overlap_schedule=True,  # a batch's logits are read before the next one runs
            **server_args,
        )
        publish(args, role="scheduler")
        self.scheduler = Scheduler(args, PortArgs.init_new(args), 0, 0, 0, 0, 0, 0, None)
        # Nobody reads the scheduler's output sockets here: drop what it would send.
        self.scheduler.ipc_channels.send_to_detokenizer.send_output = lambda *a, **k: None
        self.scheduler.ipc_channels.send_to_tokenizer.send_output = lambda *a, **k: None
        self.vocab_size = self.scheduler.model_config.vocab_size
        self._request = TokenizedGenerateReqInput
        self._sampling = SamplingParams
        self._next_rid = 0
        self.times: dict[str, float] = defaultdict(float)

    def _tick(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.times[phase] += now - since
        return now

    def rows(self, prefixes: list[list[int]]) -> np.ndarray:
        s = self.scheduler
        t = time.perf_counter()
        where: dict[str, int] = {}
        requests = []
        for i, prefix in enumerate(prefixes):
            sampling = self._sampling(max_new_tokens=0, temperature=0.0)
            sampling.normalize(None)
            sampling.verify(self.vocab_size)
            rid = f"r{self._next_rid}"
            self._next_rid += 1
            where[rid] = i
            requests.append(
                self._request(
                    rid=rid,
                    input_text=None,
                    input_ids=array("q", prefix),
                    input_embeds=None,
                    mm_inputs=None,
                    token_type_ids=None,
                    sampling_params=sampling,
                    return_logprob=False,
                    logprob_start_len=-1,
                    top_logprobs_num=0,
                    token_ids_logprob=None,
                    stream=False,
                )
            )
        s.process_input_requests(requests)
        t = self._tick("submit", t)
        out = np.empty((len(prefixes), self.vocab_size), np.float32)
        while where:
            plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
            s.running_batch = plan.running_batch
            batch = plan.batch_to_run
            t = self._tick("schedule", t)
            if batch is None:
                raise RuntimeError(f"the scheduler left {len(where)} rows unscheduled")
            result = s.run_batch(batch)
            torch.cuda.synchronize()
            t = self._tick("forward", t)
            logits = result.logits_output.next_token_logits
            host = torch.log_softmax(logits.float(), dim=-1).cpu().numpy() if logits is not None else None
            t = self._tick("rows", t)
            s.process_batch_result(batch, result)
            s.last_batch = batch
            for i, req in enumerate(batch.reqs):
                if req.finished() and req.rid in where and req is not batch.chunked_req:
                    out[where.pop(req.rid)] = host[i]
            t = self._tick("result", t)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_compare_arguments(parser)
    parser.add_argument("--profile", action="store_true", help="cProfile the scheduler way at the last P")
    parser.add_argument("--server-arg", action="append", default=[], metavar="KEY=JSON")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    extra = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.server_arg)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (
            random_model_dir(args.random_model, dtype, device, Path(tmp), args.tokenizer)
            if args.random_model
            else Path(args.model)
        )
        sglang_args = {k: v for k, v in SGLANG_ARGS.items()}
        sglang_args.update(extra)
        scheduler = SchedulerRows(model_dir, args.dtype, **sglang_args)
        transformers = TransformersEngine.load(
            EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device)
        )

        async def scheduler_rows(prefixes: list[list[int]]) -> np.ndarray:
            return scheduler.rows(prefixes)

        ways = {"scheduler": scheduler_rows, "transformers": transformers.next_token_logprobs}
        breakdown: dict[int, dict[str, float]] = {}  # per P, its last repeat's phases

        def before_repeat(particles: int) -> None:
            breakdown[particles] = scheduler.times = defaultdict(float)

        asyncio.run(compare(ways, args, before_repeat))
        print("\nScheduler way, ms per step (last repeat):\n")
        phases = ["submit", "schedule", "forward", "rows", "result"]
        print("| particles | " + " | ".join(phases) + " |")
        print("| ---: |" + " ---: |" * len(phases))
        for particles, times in breakdown.items():
            ms = [times.get(p, 0) * 1000 / args.steps for p in phases]
            print(f"| {particles} | " + " | ".join(f"{v:.2f}" for v in ms) + " |")
        if args.profile:
            prompt = [int(t) for t in np.random.default_rng(args.seed).integers(100, 40000, size=32)]
            profile = cProfile.Profile()
            profile.enable()
            asyncio.run(run_way(scheduler_rows, prompt, args.particles[-1], args.steps, args.seed))
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
            print("\n```\n" + text.getvalue()[-6000:] + "\n```")


if __name__ == "__main__":
    main()
