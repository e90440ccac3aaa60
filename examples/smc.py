"""Sequential Monte Carlo with genlm-control over the gateway: the language model is
`AsyncGatewayLM`, used exactly as genlm's local `AsyncTransformer` would be, and a regular
expression constrains what the particles may write.

Serve:  logprob-gateway serve
Run:    python examples/smc.py   (LOGPROB_GATEWAY_URL, default http://127.0.0.1:8000)
Needs genlm-control: pip install "./client[genlm]"
"""

import asyncio
import os

from genlm.control import AWRS, SMC, BoolFSA, PromptedLLM

from logprob_gateway_client import AsyncGatewayLM

BASE_URL = os.environ.get("LOGPROB_GATEWAY_URL", "http://127.0.0.1:8000")
MODEL = "smollm2-135m"


async def main() -> None:
    async with AsyncGatewayLM(BASE_URL, MODEL) as llm:
        # The potential: the model's next-token distribution after the prompt, rows from the gateway.
        potential = PromptedLLM(llm)
        potential.set_prompt_from_str("My favourite city in Europe is")

        # The constraint: a city of the list and a full stop, read off the tokens' bytes. Over the
        # whole vocabulary (prune=False), where a token it cannot spell counts as a rejection.
        cities = BoolFSA.from_regex(r" (Paris|Lyon|Marseille|Berlin|Rome)\.")
        condition = cities.coerce(potential, f=b"".join, prune=False)

        # AWRS samples each particle's next token from the model restricted to what the condition
        # allows; SMC resamples the particles by weight. Every step's rows travel in one request.
        sampler = SMC(AWRS(potential, condition, seed=0))
        try:
            sequences = await sampler(n_particles=8, ess_threshold=0.5, max_tokens=6)
        finally:
            await sampler.cleanup()

    print(f"particles: {len(sequences)}")
    for text, probability in list(sequences.decoded_posterior.items())[:3]:
        print(f"{probability:.3f} {text!r}")


asyncio.run(main())
