"""A stage's lineage as the OpenLineage provider's objects (what it says: loraflow/pipeline/lineage.py).

The stage operators' ``get_openlineage_facets_on_complete`` returns ``operator_lineage(...)``; the
provider's listener sends it with the task's COMPLETE (or FAIL) event, and only when ``[openlineage]``
names a transport (docs/operations.md, "Lineage in OpenLineage"). Imported only then: the scheduler's
DAG parsing never pays for the OpenLineage client.

Standard facets where OpenLineage has one (a dataset's version, an input's row count, an output's
size and file count); loraflow's own, ``loraflow_*``, for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attr
from airflow.providers.openlineage.extractors import OperatorLineage
from openlineage.client.event_v2 import InputDataset, OutputDataset
from openlineage.client.facet_v2 import (
    DatasetFacet,
    InputDatasetFacet,
    OutputDatasetFacet,
    RunFacet,
    data_quality_metrics_input_dataset,
    dataset_version_dataset,
    output_statistics_output_dataset,
)

from loraflow.pipeline import lineage
from loraflow.pipeline.lineage import Dataset, StageLineage

#: Names loraflow's facets: loraflow_manifest, loraflow_evaluation, ... (OpenLineage's convention for custom facets).
FACET_PREFIX = "loraflow_"
# A URI naming each facet's definition (its class below; docs/operations.md describes it): nothing is served there.
SCHEMA = "urn:loraflow:openlineage:{}:1"


class _Named:
    """A loraflow facet: its schema URI names its class."""

    @classmethod
    def _get_schema(cls) -> str:
        return SCHEMA.format(cls.__name__)


@attr.define
class ManifestDatasetFacet(_Named, DatasetFacet):
    """The committed manifest of a stage's output: where, what fingerprint, each file's size and crc32c."""

    uri: str
    fingerprint: str
    cache_key: str | None
    lock_version: str | None
    committed_at: str | None
    file_count: int
    # name, size, crc32c: a list, as file names for keys would meet the provider's secrets masking (the
    # checksum of a key naming a secret, "tokenizer.json", would read "***")
    files: list[dict[str, Any]]


@attr.define
class StageSummaryDatasetFacet(_Named, DatasetFacet):
    """A stage's summary of its output: validate_data's row counts and expectations, an evaluation's
    metrics, the gate's verdict (promote, reason, base, tuned, delta), training figures, ..."""

    stage: str
    summary: dict[str, Any]


@attr.define
class ModelVersionDatasetFacet(_Named, DatasetFacet):
    """A model version publish registered: its number, the model it is, and the Vertex AI model when there is one."""

    version: int
    pipeline: str
    registry: str
    model: str | None
    model_manifest: str | None
    model_fingerprint: str | None
    vertex_model: str | None


@attr.define
class HandoffDatasetFacet(_Named, DatasetFacet):
    """The data team's dataset version (docs/data-handoff.md) a dataset lies in."""

    prefix: str
    version: str


@attr.define
class StageRunFacet(_Named, RunFacet):
    """Which commit the task ended with, whether it was reused from the cache, and the config it was computed with."""

    stage: str
    manifest: str
    cached: bool
    cache_key: str | None
    lock_version: str | None
    config: dict[str, Any]


# The core's facet names (loraflow/pipeline/lineage.py) -> their classes; any other is a stage summary.
DATASET_FACETS: dict[str, type[DatasetFacet]] = {
    "manifest": ManifestDatasetFacet,
    "model_version": ModelVersionDatasetFacet,
    "handoff": HandoffDatasetFacet,
}


def operator_lineage(stage: StageLineage) -> OperatorLineage:
    """The provider's ``OperatorLineage`` of a stage's lineage."""
    return OperatorLineage(
        inputs=[_input(d) for d in stage.inputs],
        outputs=[_output(d) for d in stage.outputs],
        run_facets={FACET_PREFIX + "stage": StageRunFacet(**stage.run)},
    )


def finished_stage(manifest: Mapping[str, Any], cached: bool, handoff_prefix: str | None) -> OperatorLineage:
    return operator_lineage(lineage.stage_lineage(manifest, cached, handoff_prefix))


def _input(dataset: Dataset) -> InputDataset:
    facets: dict[str, InputDatasetFacet] = {}
    if dataset.row_count is not None:
        facets["dataQualityMetrics"] = data_quality_metrics_input_dataset.DataQualityMetricsInputDatasetFacet(
            columnMetrics={}, rowCount=dataset.row_count
        )
    return InputDataset(dataset.namespace, dataset.name, facets=_dataset_facets(dataset), inputFacets=facets)


def _output(dataset: Dataset) -> OutputDataset:
    facets: dict[str, OutputDatasetFacet] = {}
    if dataset.size is not None:
        facets["outputStatistics"] = output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
            size=dataset.size, fileCount=dataset.file_count
        )
    return OutputDataset(dataset.namespace, dataset.name, facets=_dataset_facets(dataset), outputFacets=facets)


def _dataset_facets(dataset: Dataset) -> dict[str, DatasetFacet]:
    facets: dict[str, DatasetFacet] = {}
    if dataset.version is not None:
        facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=dataset.version)
    for name, fields in dataset.facets.items():
        facets[FACET_PREFIX + name] = DATASET_FACETS.get(name, StageSummaryDatasetFacet)(**fields)
    return facets
