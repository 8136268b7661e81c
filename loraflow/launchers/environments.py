"""The three runtime environments: which stage runs where, and where their lock files and venvs are.

Each environment is one lock file (``envs/<name>.lock``), one local virtual environment
(``.venvs/<name>``, made by ``make envs``) and one container image (``docker/<name>.Dockerfile``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from loraflow.errors import LoraflowError

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Environment:
    name: str
    python: str
    purpose: str

    @property
    def lock_file(self) -> Path:
        return REPO_ROOT / "envs" / f"{self.name}.lock"

    def lock_version(self) -> str:
        from loraflow.pipeline.artifacts import lock_version

        if not self.lock_file.exists():
            raise LoraflowError(f"lock file {self.lock_file} is missing; run `make lock`")
        return lock_version(self.lock_file)

    def venv_python(self) -> Path:
        """Where this environment's interpreter is on this machine (``make envs`` puts it there)."""
        base = Path(os.environ.get("LORAFLOW_ENVS_DIR", REPO_ROOT / ".venvs"))
        return base / self.name / "bin" / "python"

    def local_python(self) -> Path:
        python = self.venv_python()
        if not python.exists():
            raise LoraflowError(
                f"the {self.name} environment is not installed at {python.parent.parent}; run `make envs`"
            )
        return python


ENVIRONMENTS = {
    "control": Environment("control", "3.12", "Airflow, Great Expectations, the light steps"),
    "trainer": Environment("trainer", "3.12", "MaxText + Tunix on JAX (TPU in production)"),
    "serving": Environment("serving", "3.11", "vLLM"),
}
