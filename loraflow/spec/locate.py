"""Finding a pipeline's spec by its name: ``{pipelines folder}/{name}.yaml`` (a spec's file is named
after it), the folder being ``$LORAFLOW_PIPELINES_DIR`` or the repository's ``pipelines/``, as for
the DAG folder."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from loraflow.errors import LoraflowError
from loraflow.spec.cache import discover

if TYPE_CHECKING:
    from loraflow.spec.schema import PipelineSpec

PIPELINES_ENV = "LORAFLOW_PIPELINES_DIR"
PIPELINES_DEFAULT = f"${PIPELINES_ENV} or the repository's pipelines/"  # what a command's help says
_REPO_PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def pipelines_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get(PIPELINES_ENV) or _REPO_PIPELINES)


def pipeline_names(folder: Path) -> list[str]:
    """The names of the specs in ``folder`` (their file names), without validating them."""
    return [p.stem for p in discover(folder)]


def spec_named(name_or_path: str, folder: Path) -> PipelineSpec:
    """The validated spec of pipeline ``name_or_path`` in ``folder``, or of the spec file it names."""
    from loraflow.spec.schema import load_spec

    given = Path(name_or_path)
    if given.suffix in (".yaml", ".yml") and given.is_file():
        return load_spec(given)
    names = pipeline_names(folder)
    if name_or_path not in names:
        listed = ", ".join(names) or "none"
        raise LoraflowError(
            f"no pipeline {name_or_path!r} in {folder} (its pipelines: {listed}); give a spec's name or its "
            f"YAML file, or point --pipelines / {PIPELINES_ENV} at the folder that holds it"
        )
    return load_spec(folder / f"{name_or_path}.yaml")
