"""The Airflow side of a spec's ``secrets``: read connections at execute time, mask the values.

The core (``loraflow.launchers.credentials``) decides which secrets a stage gets and reads their fields; here
the lookup is Airflow's (connections from the metadata DB, ``AIRFLOW_CONN_*`` variables or the
configured secrets backend), and every value is registered with Airflow's secret masker before any
log line could carry it.
"""

from __future__ import annotations

from loraflow.launchers import credentials
from loraflow.spec.schema import PipelineSpec


def resolve_secrets(spec: PipelineSpec, stage: str) -> dict[str, str]:
    """``{ENV_NAME: value}`` for ``stage``, each value already masked in the task log."""
    if not credentials.wanted(spec, stage):
        return {}
    from airflow.sdk import Connection
    from airflow.sdk.log import mask_secret

    values = credentials.resolve(spec, stage, Connection.get)
    for name, value in values.items():
        mask_secret(value, name)
    return values
