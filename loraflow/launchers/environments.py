"""The three runtime environments: which stage runs where, and where their lock files and venvs are.

Each environment is one lock file (``envs/<name>.lock``), one local virtual environment
(``.venvs/<name>``, made by ``make envs``) and one container image (``docker/<name>.Dockerfile``).
The serving image has two more builds, for TPU and CUDA machines: their locks, no local venv.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loraflow.errors import LoraflowError

if TYPE_CHECKING:
    from loraflow.spec.compute import AnyCompute

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
        from loraflow.storage.artifacts import lock_version

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
# The serving stages' accelerator builds: images only (docker/serving.Dockerfile SERVING_BUILD=tpu|cuda),
# each from its own lock, so that a stage's cache key follows the vLLM build that ran it.
ACCELERATOR_SERVING = {
    "tpu": Environment("serving-tpu", "3.12", "vLLM's TPU build (vllm-tpu), in the serving image"),
    "cuda": Environment("serving-cuda", "3.12", "vLLM's CUDA build, in the serving image"),
}


def environment_for(name: str, compute: AnyCompute) -> Environment:
    """Where a stage of environment ``name`` runs on ``compute``: that environment, or for a serving stage
    whose image is an accelerator build (``compute.<stage>.serving_build``), that build's."""
    build = getattr(compute, "serving_build", None)
    if name == "serving" and build in ACCELERATOR_SERVING:
        return ACCELERATOR_SERVING[build]
    return ENVIRONMENTS[name]
