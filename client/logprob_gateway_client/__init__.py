"""The gateway's Python client: `AsyncGatewayLM`, genlm-backend's `AsyncLM` over HTTP.

Needs only httpx, msgspec and numpy; returns torch tensors when torch is installed.
"""

from logprob_gateway_client.encoding import DTYPES, Dtype
from logprob_gateway_client.lm import AsyncGatewayLM
from logprob_gateway_client.wire import GatewayClientError

__all__ = ["DTYPES", "AsyncGatewayLM", "Dtype", "GatewayClientError"]
