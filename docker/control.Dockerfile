# control: Airflow (scheduler, API server, workers) + the light loraflow steps.
# Build from the repository root:  docker build -f docker/control.Dockerfile -t loraflow/control .
# Same recipe as `make envs`: the environment is exactly envs/control.lock.
FROM python:3.12-slim
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
USER 50000
