"""The faults and the secret tests/e2e/test_faults_airflow.py plants in the shared stack (tests/e2e/conftest.py)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class PlantedFaults:
    """What test_faults_airflow.py plants in the shared stack's processes as it starts: one SIGKILL per stage
    of its own pipeline's steps (``PIPELINE/STAGE:POINT`` entries, ``loraflow/storage/faults.py``: no other
    module's step is killed) and an HF token in an Airflow connection, which only its pipeline uses."""

    state: Path  # LORAFLOW_FAULT_STATE: a marker per fault that fired
    token: str = field(default_factory=lambda: "hf_" + secrets.token_urlsafe(24))
    dag: str = "tiny-faults"
    connection: str = "loraflow_hf_test"
    # One kill per stage. lora_sft checkpoints at steps 1, 50, 100, ...; it dies while persisting its third
    # checkpoint (step 100): the files are uploaded, the completion marker is not, so the retry must
    # resume from step 50.
    kills: dict[str, str] = field(
        default_factory=lambda: {
            "validate_data": "before_manifest",
            "convert_checkpoint": "mid_upload",
            "evaluate_base": "before_manifest",
            "lora_sft": "checkpoint_upload@3",
            "merge_adapter": "mid_merge",
            "evaluate_tuned": "mid_upload",
            "gate": "before_manifest",
            "publish": "before_manifest",
            "report": "before_manifest",
        }
    )

    @property
    def env(self) -> dict[str, str]:
        return {
            "LORAFLOW_FAULT": ",".join(f"{self.dag}/{stage}:{point}" for stage, point in self.kills.items()),
            "LORAFLOW_FAULT_STATE": str(self.state),
            f"AIRFLOW_CONN_{self.connection.upper()}": json.dumps({"conn_type": "generic", "password": self.token}),
        }
