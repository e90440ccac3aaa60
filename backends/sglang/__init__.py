"""The SGLang engine: SGLang's scheduler, one request per row or prompt, and its weight calls."""
