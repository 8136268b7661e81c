# trainer: MaxText + Tunix on JAX for TPU hosts (convert_checkpoint, lora_sft, merge_adapter).
# Build from the repository root:  docker build -f docker/trainer.Dockerfile -t loraflow/trainer .
# Same recipe as `make envs`: the environment is exactly envs/trainer.lock (maxtext[tpu] brings libtpu).
# Vertex AI / GKE run: python -m loraflow.steps.<stage> --output gs://... --input NAME=gs://... (see `loraflow plan`).
# PYTHON312_IMAGE: the base, python:3.12-slim-bookworm unless given (`make images` passes a local one
# made from Debian's packages where no registry can be reached: docker/local-base.sh).
ARG PYTHON312_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON312_IMAGE}
# uv keeps no cache in the image: its layers hold the environment only (files copied into it, not linked).
# It compiles the environment to bytecode as it installs it: every task starts a container afresh, which would
# otherwise compile each module it imports from source (importing MaxText: 30 CPU s against 10).
ENV UV_NO_CACHE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_COMPILE_BYTECODE=1
RUN pip install --no-cache-dir uv
WORKDIR /opt/loraflow
COPY envs/trainer.lock envs/trainer.lock
RUN uv venv /opt/venv && uv pip sync -p /opt/venv envs/trainer.lock
COPY envs/ envs/
COPY loraflow/ loraflow/
# The native merge kernel (merge_adapter); the compiler is removed once it is built.
RUN apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev \
    && loraflow/lora/native/build.sh \
    && apt-get purge -y -q gcc libc6-dev && apt-get autoremove -y -q && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/loraflow \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
ENTRYPOINT ["python"]
