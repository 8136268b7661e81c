"""Airflow's logging configuration for the local Celery stack: task logs in the GCS emulator.

``[logging] logging_config_class = operators.emulator_task_logs.LOGGING_CONFIG`` (set by
``loraflow.dev.demo`` when it runs Celery workers, with ``remote_base_log_folder`` a gs:// prefix).

Airflow's GCS task-log handler appends a try's log to what the object already holds: it reads the
object first, and writes only when that read succeeded or failed because there is no object yet, which
it recognises by GCS's message for a missing object ("No such object: ..."). fake-gcs-server answers a
missing object with a 404 whose text is "Not Found", so against the emulator every upload is refused
(the log stays on the worker's disk, where neither the API server nor the other workers can read it).
This handler also takes a 404 (``google.api_core.exceptions.NotFound``) as "no log yet"; everything
else, and the whole configuration besides, is Airflow's own. On real GCS it changes nothing.
"""

from __future__ import annotations

from typing import Any

from airflow.config_templates.airflow_local_settings import DEFAULT_LOGGING_CONFIG
from airflow.providers.google.cloud.log.gcs_task_handler import GCSRemoteLogIO
from google.api_core.exceptions import NotFound


class EmulatorGCSRemoteLogIO(GCSRemoteLogIO):  # type: ignore[misc]  # Airflow's class is untyped
    @staticmethod
    def no_log_found(exc: Any) -> bool:
        return isinstance(exc, NotFound) or bool(GCSRemoteLogIO.no_log_found(exc))


LOGGING_CONFIG: dict[str, Any] = DEFAULT_LOGGING_CONFIG
REMOTE_TASK_LOG = EmulatorGCSRemoteLogIO.from_config()
