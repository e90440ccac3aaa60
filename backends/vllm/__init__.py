"""The vLLM engine: vLLM's v1 AsyncLLM in this process, and what its workers run."""
