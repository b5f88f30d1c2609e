# syntax=docker/dockerfile:1
# GPU image: CUDA runtime + Python venv with torch (CUDA build), Ray Serve and hybrid-serve.
# The Helm chart runs it as Ray head and GPU workers (KubeRay replaces the CMD with `ray start`);
# `docker run --gpus all -v /path/to/model:/models/model IMAGE` serves one model on its own.
# Build from the repository root:
#   docker build -f dockerfiles/gpu.Dockerfile -t hybrid-serve-gpu:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG RAY_VERSION=2.60.0
# The README's GPU install: the default PyPI build of torch (it bundles its CUDA libraries).
ARG TORCH_SPEC=torch
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# python3-dev + gcc: Triton compiles its launcher at run time. wget: KubeRay's health probes.
# bash: KubeRay's `bash -lc` start command; a login shell resets PATH, hence the profile.d entry.
# uid 1000 is `ray` (the chart's runAsUser); Ubuntu 24.04 images ship uid 1000 as `ubuntu`.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev gcc libc6-dev bash wget ca-certificates tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV" \
 && echo 'export VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH' > /etc/profile.d/hybrid-serve-venv.sh \
 && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && useradd --create-home --uid 1000 --shell /bin/bash ray \
 && pip install --upgrade pip

RUN pip install "${TORCH_SPEC}"

# The package itself, installed like the README does (pip install of the repository).
WORKDIR /opt/hybrid-serve
COPY pyproject.toml ./
COPY service ./service
RUN pip install "ray[serve]==${RAY_VERSION}" . \
 && hybrid-serve --help >/dev/null

# Non-root, and nothing written outside $HOME and /tmp at run time (the chart mounts both as emptyDirs
# under a read-only root filesystem): bytecode was compiled at install.
USER 1000
ENV HOME=/home/ray \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/ray
# serve (OpenAI API), Ray dashboard, GCS, Ray client, Ray metrics agent
EXPOSE 8000 8265 6379 10001 8080
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["hybrid-serve", "serve", "--model-path", "/models/model", "--tp", "1", "--ep", "1", "--replicas", "1", "--page-size", "64", "--mamba-cache-strategy", "extra_buffer", "--reasoning-parser", "nemotron_3", "--tool-call-parser", "qwen3_coder", "--host", "0.0.0.0", "--port", "8000"]
