"""Who a remote workload is for: the same DAG, run, stage and cache key always name the same job.

Every remote launcher names its workload from a ``JobIdentity`` (a Vertex AI CustomJob's labels and
display name, a GKE JobSet's name), so a retried or restarted task finds the job its earlier try
started and reattaches to it instead of starting a second writer.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

JOB_LABEL = "loraflow-job"


@dataclass(frozen=True)
class JobIdentity:
    """Who a CustomJob is for: the same four values always name the same job."""

    dag_id: str
    run_id: str
    stage: str
    cache_key: str

    @property
    def key(self) -> str:
        raw = "\0".join((self.dag_id, self.run_id, self.stage, self.cache_key))
        return hashlib.sha256(raw.encode()).hexdigest()[:40]

    @property
    def display_name(self) -> str:
        # Up to 128 characters of any UTF-8; the key at the end keeps it unique when truncated.
        return f"loraflow.{self.dag_id[:50]}.{self.stage}.{self.key}"

    @property
    def labels(self) -> dict[str, str]:
        return {
            JOB_LABEL: self.key,
            "loraflow-stage": label_value(self.stage),
            "loraflow-dag": label_value(self.dag_id),
        }

    @property
    def list_filter(self) -> str:
        return f'labels.{JOB_LABEL}="{self.key}"'


def label_value(text: str) -> str:
    """A Vertex/GCP label value: lowercase letters, digits, '-' and '_', at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]
