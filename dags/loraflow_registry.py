"""The registry's maintenance DAG, loraflow_registry: list a pipeline's registered models, promote
one, roll the champion back, from Airflow's trigger form or REST API (operators/registry.py). Its
pipeline param offers the specs in pipelines/ (or $LORAFLOW_PIPELINES_DIR), read by name only."""

from loraflow.spec.locate import pipelines_dir
from operators.registry import registry_dag

loraflow_registry = registry_dag(pipelines_dir())
