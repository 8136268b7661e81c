"""What a stage reports to an OpenLineage backend (Marquez, Dataplex): the datasets it read and wrote,
with the facts a user follows lineage for.

Built from the stage's committed manifest (``artifacts.commit``) alone: its inputs' URIs and
fingerprints, its files' sizes and crc32c, its resolved config and its summary. Pure data, no I/O;
``operators/lineage.py`` turns a ``StageLineage`` into the OpenLineage provider's objects (it imports
the provider, this module imports neither it nor Airflow).

Datasets are named as OpenLineage names GCS objects: namespace ``gs://BUCKET``, name the object path.
A stage's output is its committed prefix (the artifact its ``_MANIFEST.json`` lists), and a downstream
stage names that same prefix as its input, with the same version (the files' fingerprint), so the
stages chain::

    datasets/parity/train.jsonl -> validate_data -> RUN/validate_data -> lora_sft -> RUN/lora_sft
      -> merge_adapter -> RUN/merge_adapter (the model) -> publish -> registry/PIPELINE/versions/0001.json

Facets (``Dataset.facets``, reported as ``loraflow_<name>``): every output carries ``manifest`` (its
URI, fingerprint, cache key, lock version and each file's size and crc32c) and its summary under the
stage table's ``lineage_facet`` (validate_data's ``data_contract``, the evaluations' ``evaluation``, the
gate's ``gate_decision``, ...); an input whose rows the stage counted (a ``<input>_rows`` summary
figure: validate_data's train and eval) carries the count; a hand-off dataset version carries
``handoff``; publish's registry version carries ``model_version``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loraflow.registry import store
from loraflow.spec.stages import BY_NAME
from loraflow.storage import artifacts, gcs
from loraflow.storage.summaries import PublishSummary, SummaryError

#: The most files a ``manifest`` facet lists, by name; its ``file_count`` and ``fingerprint`` cover them all.
MAX_FILES = 200


@dataclass(frozen=True)
class Dataset:
    """One dataset of an OpenLineage event: where it is, which version, and what loraflow knows of it."""

    namespace: str  # gs://BUCKET
    name: str  # the object path (a committed artifact's prefix)
    version: str | None = None  # its content fingerprint (a registry version: its number)
    row_count: int | None = None  # an input: the rows the stage counted in it
    size: int | None = None  # an output: bytes written
    file_count: int | None = None  # an output: files written
    facets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # loraflow's own, by name


@dataclass(frozen=True)
class StageLineage:
    inputs: tuple[Dataset, ...]
    outputs: tuple[Dataset, ...]
    run: Mapping[str, Any]  # the run facet loraflow_stage: which commit, whether reused, from which config


def dataset_id(uri: str) -> tuple[str, str]:
    """``gs://b/p/_MANIFEST.json`` and ``gs://b/p/`` -> ``("gs://b", "p")``: a manifest stands for its prefix."""
    if uri.endswith("/" + artifacts.MANIFEST):
        uri = uri.rsplit("/", 1)[0]
    bucket, path = gcs.split_uri(uri)
    return f"gs://{bucket}", path.rstrip("/")


def dataset_uri(uri: str) -> str:
    """The URI of the dataset ``uri`` is (or whose manifest it is): ``gs://b/p/_MANIFEST.json`` -> ``gs://b/p``."""
    namespace, path = dataset_id(uri)
    return f"{namespace}/{path}"


def stage_lineage(manifest: Mapping[str, Any], cached: bool, handoff_prefix: str | None = None) -> StageLineage:
    """The lineage of a stage's committed ``manifest`` (its JSON); ``cached``: this run reused it;
    ``handoff_prefix``: the spec's hand-off prefix (an input in one of its folders is a dataset version)."""
    stage, summary = str(manifest["stage"]), dict(manifest.get("summary") or {})
    inputs = [_input(name, record, summary, handoff_prefix) for name, record in dict(manifest["inputs"]).items()]
    outputs = [_output(manifest, stage, summary)]
    version = _registry_version(manifest, summary)
    if version is not None:
        outputs.append(version)
    run = {
        "stage": stage,
        "manifest": artifacts.manifest_uri(str(manifest["prefix"])),
        "cached": cached,
        "cache_key": manifest.get("cache_key"),
        "lock_version": manifest.get("lock_version"),
        "config": dict(manifest.get("config") or {}),
    }
    return StageLineage(_unique(inputs), tuple(outputs), run)


def _unique(datasets: list[Dataset]) -> tuple[Dataset, ...]:
    """One dataset per namespace and name (two inputs of a stage may be the same object)."""
    return tuple({(d.namespace, d.name): d for d in datasets}.values())


def _input(name: str, record: Mapping[str, Any], summary: Mapping[str, Any], handoff_prefix: str | None) -> Dataset:
    uri = str(record["uri"])
    namespace, path = dataset_id(uri)
    rows = summary.get(f"{name}_rows")
    version = handoff_version(uri, handoff_prefix)
    facets = {"handoff": {"prefix": handoff_prefix, "version": version}} if version else {}
    return Dataset(
        namespace,
        path,
        version=record.get("fingerprint"),
        row_count=rows if isinstance(rows, int) and not isinstance(rows, bool) else None,
        facets=facets,
    )


def handoff_version(uri: str, handoff_prefix: str | None) -> str | None:
    """The hand-off dataset version ``uri`` lies in (``{prefix}/{version}/train.jsonl`` -> ``version``), or None."""
    if not handoff_prefix:
        return None
    folder = handoff_prefix.rstrip("/") + "/"
    if not uri.startswith(folder):
        return None
    version, sep, _ = uri[len(folder) :].partition("/")
    return version if sep and version else None


def _output(manifest: Mapping[str, Any], stage: str, summary: Mapping[str, Any]) -> Dataset:
    """The stage's committed artifact: its files, their fingerprint and checksums, and its summary."""
    prefix = str(manifest["prefix"])
    files: Mapping[str, Mapping[str, Any]] = manifest["files"]
    fingerprint = artifacts.fingerprint(files)
    listed = sorted(files)[:MAX_FILES]
    namespace, path = dataset_id(prefix)
    facets: dict[str, dict[str, Any]] = {
        "manifest": {
            "uri": artifacts.manifest_uri(prefix),
            "fingerprint": fingerprint,
            "cache_key": manifest.get("cache_key"),
            "lock_version": manifest.get("lock_version"),
            "committed_at": manifest.get("committed_at"),
            "file_count": len(files),
            "files": [{"name": name, "size": files[name]["size"], "crc32c": files[name]["crc32c"]} for name in listed],
        },
        BY_NAME[stage].lineage_facet: {"stage": stage, "summary": dict(summary)},
    }
    size = sum(int(entry["size"]) for entry in files.values())
    return Dataset(namespace, path, version=fingerprint, size=size, file_count=len(files), facets=facets)


def _registry_version(manifest: Mapping[str, Any], summary: Mapping[str, Any]) -> Dataset | None:
    """The registry version a publish wrote (``versions/NNNN.json``); None when nothing was published."""
    if manifest["stage"] != "publish":
        return None
    try:
        outcome = PublishSummary.from_object(summary, "publish's summary")
    except SummaryError:  # lineage says what it can: a summary publish did not write names no version
        return None
    number = outcome.version
    if not outcome.promoted or number is None:
        return None
    config = manifest["config"]
    uri = store.version_uri(str(config["registry_uri"]), str(config["pipeline"]), number)
    namespace, path = dataset_id(uri)
    model = str(outcome.model_manifest)  # the model input's, or (a publish by hand) its config's
    facet = {
        "version": number,
        "pipeline": config["pipeline"],
        "registry": config["registry_uri"],
        "model": dataset_uri(model),
        "model_manifest": model,
        "model_fingerprint": (dict(manifest["inputs"]).get("model") or {}).get("fingerprint"),
        "vertex_model": summary.get("vertex_model"),
    }
    return Dataset(namespace, path, version=str(number), facets={"model_version": facet})
