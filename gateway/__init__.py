"""The HTTP gateway: OpenAI-compatible API in front of the engines in `backends`."""
