"""One DAG per pipeline spec in pipelines/ (or $LORAFLOW_PIPELINES_DIR).

An invalid spec becomes an import error of this file that names the spec and every problem in it;
the DAGs of all valid specs still load. Parsing imports no ML library; its only I/O is reading the
spec files and the spec cache (loraflow/spec/cache.py: an unchanged spec is not validated again).
"""

from airflow.sdk import DAG

from loraflow.spec.locate import pipelines_dir
from operators.dag_factory import load_pipelines

pipelines: dict[str, DAG] = load_pipelines(pipelines_dir())
globals().update(pipelines)
