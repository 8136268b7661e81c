# control: Airflow (scheduler, API server, workers) + the light loraflow steps.
# Build from the repository root:  docker build -f docker/control.Dockerfile -t loraflow/control .
# Same recipe as `make envs`: the environment is exactly envs/control.lock.
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
COPY envs/control.lock envs/control.lock
RUN uv venv /opt/venv && uv pip sync -p /opt/venv envs/control.lock
COPY pyproject.toml README.md ./
COPY envs/ envs/
COPY loraflow/ loraflow/
COPY operators/ operators/
COPY dags/ /opt/airflow/dags/
COPY pipelines/ /opt/airflow/pipelines/
RUN uv pip install -p /opt/venv --no-deps -e .
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/loraflow \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/airflow/dags \
    LORAFLOW_PIPELINES_DIR=/opt/airflow/pipelines \
    LORAFLOW_ENVS_DIR=/opt
# The local launcher finds this environment's interpreter at $LORAFLOW_ENVS_DIR/control/bin/python.
RUN ln -s /opt/venv /opt/control
# Airflow runs as uid 50000 (gid 0), as in Airflow's own image: a home, and AIRFLOW_HOME writable for its
# logs and config (the DAG and spec folders stay root's, read-only).
RUN useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow airflow && chown airflow:0 /opt/airflow
ENV AIRFLOW_HOME=/opt/airflow
USER 50000
