# syntax=docker/dockerfile:1
# CPU demo image: serves the embedded tiny NemotronH with two replicas behind the prefix-aware router.
#   docker build -f dockerfiles/cpu-demo.Dockerfile -t hybrid-serve-cpu-demo:0.1.0 .
#   docker run -p 8000:8000 hybrid-serve-cpu-demo:0.1.0   # then: curl localhost:8000/v1/models
# The Helm chart's examples/cpu-demo.yaml runs the same image on KubeRay.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG RAY_VERSION=2.60.0
ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

# wget: KubeRay's health probes; gcc: the engine's native CPU kernels (built below; the build key asks the compiler's
# version at run time). uid 1000 is `ray` (the chart's runAsUser).
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget tini gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 1000 --shell /bin/bash ray \
 && pip install --upgrade pip

# The README pins torch==2.13.0; in a container its CPU build comes from the PyTorch CPU index.
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

# The package itself, installed like the README does (pip install of the repository).
WORKDIR /opt/hybrid-serve
COPY pyproject.toml ./
COPY service ./service
RUN pip install "ray[serve]==${RAY_VERSION}" .

# The embedded model, written once at build time so every Ray node serves identical weights.
RUN hybrid-serve make-tiny-model /opt/hybrid-serve/models/tiny

# The native CPU kernels (the default kernel backend on CPU), compiled once here: the root filesystem is read-only
# at run time, and every replica loads this build.
ENV HYBRID_SERVE_NATIVE_CACHE=/opt/hybrid-serve/native
RUN python -c "from service.engine.kernels.cpu_native import native_library; native_library()"

# Non-root, and nothing written outside $HOME and /tmp at run time (the chart mounts both as emptyDirs
# under a read-only root filesystem): bytecode was compiled at install.
USER 1000
ENV HOME=/home/ray \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/ray
EXPOSE 8000 8265 6379 10001 8080
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["hybrid-serve", "serve", "--model-path", "/opt/hybrid-serve/models/tiny", "--tp", "1", "--ep", "1", "--replicas", "2", "--page-size", "16", "--mamba-cache-strategy", "extra_buffer", "--reasoning-parser", "nemotron_3", "--tool-call-parser", "qwen3_coder", "--host", "0.0.0.0", "--port", "8000"]
