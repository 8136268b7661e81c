# serving: vLLM for evaluate_base / evaluate_tuned.
# Build from the repository root:  docker build -f docker/serving.Dockerfile -t loraflow/serving .
# Same recipe as `make envs`: envs/serving.lock on Python 3.11. The lock pins the CPU torch build
# (torch==2.13.0+cpu); put that wheel in docker/wheels/ (or build with a lock for your accelerator).
FROM python:3.11-slim
RUN pip install --no-cache-dir uv
WORKDIR /opt/loraflow
COPY envs/serving.lock envs/serving.lock
COPY docker/wheels/ /wheels/
RUN uv venv /opt/venv && uv pip sync -p /opt/venv --find-links /wheels envs/serving.lock
COPY envs/ envs/
COPY loraflow/ loraflow/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/loraflow \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0
ENTRYPOINT ["python"]
