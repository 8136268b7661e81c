"""One DAG per pipeline spec in pipelines/ (or $LORAFLOW_PIPELINES_DIR).

An invalid spec becomes an import error of this file that names the spec and every problem in it;
the DAGs of all valid specs still load. Parsing imports no ML library; its only I/O is reading the
spec files and the spec cache (loraflow/spec/cache.py: an unchanged spec is not validated again).
"""

import os
from pathlib import Path

from airflow.sdk import DAG

from operators.dag_factory import load_pipelines

PIPELINES_DIR = Path(os.environ.get("LORAFLOW_PIPELINES_DIR", Path(__file__).resolve().parents[1] / "pipelines"))

pipelines: dict[str, DAG] = load_pipelines(PIPELINES_DIR)
globals().update(pipelines)
