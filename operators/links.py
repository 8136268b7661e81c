"""Operator extra links of the stage tasks: the Vertex AI job, the stage's artifacts, the data docs,
the run report and the run in Vertex AI Experiments.

Each URL is decided while the task runs and kept in XCom under the link's ``xcom_key`` (the
GCS emulator's download URL locally, the Cloud console's in GCP); Airflow's UI shows it from
there. A stage that ran locally has no remote job link.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow.sdk import BaseOperator, BaseOperatorLink

from loraflow.reporting.urls import browser_url
from loraflow.storage import artifacts, gcs

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey


class XComLink(BaseOperatorLink):
    """A link whose URL the task pushed to XCom under ``xcom_key``; empty until it did."""

    name = ""

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.bases.xcom import BaseXCom

        url = BaseXCom.get_value(ti_key=ti_key, key=self.xcom_key)  # type: ignore[arg-type]
        return url if isinstance(url, str) else ""


class WorkloadLink(XComLink):
    """'Remote job': where the stage's remote workload is watched. A Vertex AI stage: the CustomJob's
    page in the Cloud console; a GKE stage: the Logs Explorer on the JobSet's pods."""

    name = "Remote job"


class ArtifactsLink(XComLink):
    """'Artifacts': the stage's committed manifest (it lists every file with its checksum)."""

    name = "Artifacts"


class DataDocsLink(XComLink):
    """'Data docs' on validate_data: Great Expectations' HTML data docs of the train and eval checks,
    beside the committed dataset, or beside the rejection evidence when the data broke its contract."""

    name = "Data docs"


class ReportLink(XComLink):
    """'Run report' on the report task: the run's report.html."""

    name = "Run report"


class ExperimentLink(XComLink):
    """'Vertex AI experiment' on the report task: the run's page in Vertex AI Experiments (its parameters,
    metrics and curves), when the spec sets ``tracking.vertex``; empty otherwise."""

    name = "Vertex AI experiment"


def artifacts_url(prefix: str, emulator_host: str | None) -> str:
    """Where a browser shows a stage's output: the manifest via the GCS emulator, else the console's browser."""
    if emulator_host:
        return browser_url(artifacts.manifest_uri(prefix), emulator_host)
    bucket, path = gcs.split_uri(prefix)
    return f"https://console.cloud.google.com/storage/browser/{bucket}/{path}"
