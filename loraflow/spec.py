"""The pipeline spec: schema, loading, and validation that reports every error at once.

A spec is one YAML file in ``pipelines/``. ``load_spec(path)`` returns a ``PipelineSpec`` or raises
``SpecError`` listing every problem as ``key.path: what is wrong; what to write instead``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from loraflow.errors import SpecError

STAGES = (
    "validate_data",
    "convert_checkpoint",
    "evaluate_base",
    "lora_sft",
    "merge_adapter",
    "evaluate_tuned",
    "gate",
    "publish",
    "report",
)
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_CRON_FIELD = re.compile(r"^[\d*/,\-A-Za-z?LW#]+$")
# libyaml's safe loader where present (about 8x faster: DAG parsing reads every spec), else Python's.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_CRON_PRESETS = {"@once", "@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@annually"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _gs_uri(value: str) -> str:
    if not value.startswith("gs://") or len(value) <= len("gs://") or value[5] == "/":
        raise ValueError(f"{value!r} is not a GCS URI; write gs://BUCKET/PATH")
    if ".." in value.split("/"):
        raise ValueError(f"{value!r} contains '..'; write the full path without parent references")
    return value.rstrip("/")


GsUri = Annotated[str, Field(description="a gs://BUCKET/PATH URI")]


class BaseModelSpec(_Model):
    """The model being tuned."""

    hf_checkpoint: GsUri = Field(description="Hugging Face checkpoint directory (config, safetensors, tokenizer)")
    maxtext_model: str = Field(description="MaxText model name, e.g. llama3.1-8b")
    tokenizer: GsUri | None = Field(None, description="tokenizer directory; defaults to hf_checkpoint")
    model_overrides: dict[str, int | float | str | bool] = Field(
        default_factory=dict, description="MaxText config overrides (e.g. the tiny model's dimensions)"
    )

    _uris = field_validator("hf_checkpoint", "tokenizer")(lambda v: v if v is None else _gs_uri(v))


class DataSpec(_Model):
    """The training data, the eval set, and the data contract."""

    train: GsUri = Field(description="training dataset: one JSONL or Parquet file (prompt/completion or messages)")
    eval: GsUri = Field(description="held-out eval set, same formats")
    min_rows: int = Field(100, ge=1, description="fewest training rows accepted")
    min_tokens: int = Field(1, ge=0, description="fewest tokens an example may have")
    max_tokens: int = Field(512, ge=8, description="most tokens an example may have (chat-rendered)")
    max_duplicate_fraction: float = Field(0.0, ge=0, le=1, description="share of duplicate examples tolerated")

    _uris = field_validator("train", "eval")(_gs_uri)


class LoraSpec(_Model):
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r")
    target_modules: list[str] | None = Field(
        None, description="regexes over MaxText parameter paths; null = MaxText's default (all projections)"
    )


class TrainingSpec(_Model):
    steps: int = Field(100, ge=1, description="optimizer steps")
    batch_size: int = Field(8, ge=1, description="global batch size (examples per step)")
    learning_rate: float = Field(1e-4, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(512, ge=8, description="tokens per packed training sequence")
    seed: int = Field(0, ge=0, description="data order and initialisation seed")
    checkpoint_period: int = Field(50, ge=1, description="save an Orbax checkpoint every N steps (and at the end)")
    dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="compute dtype (float32 on CPU)")


class EvaluationSpec(_Model):
    max_new_tokens: int = Field(16, ge=1, le=4096)
    batch_size: int = Field(64, ge=1)
    seed: int = Field(0, ge=0)
    answer_pattern: str = Field(r"^\s*([^\s<]+)", description="regex; group 1 is the answer compared to the reference")
    max_examples: int | None = Field(None, ge=1, description="evaluate only the first N examples")
    max_model_len: int = Field(1024, ge=16)

    @field_validator("answer_pattern")
    @classmethod
    def _regex(cls, v: str) -> str:
        try:
            compiled = re.compile(v)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression ({exc})") from None
        if compiled.groups < 1:
            raise ValueError("needs one capturing group around the answer, e.g. ^\\s*(\\S+)")
        return v


class GateSpec(_Model):
    metric: Literal["accuracy", "format_rate"] = "accuracy"
    min_improvement: float = Field(0.0, ge=-1, le=1, description="tuned - base must reach at least this")
    confidence: float = Field(0.95, gt=0.5, lt=1)
    bootstrap_samples: int = Field(2000, ge=100)


class PublishSpec(_Model):
    registry: GsUri | None = Field(None, description="registry prefix; default {artifact_root}/_registry")

    _uris = field_validator("registry")(lambda v: v if v is None else _gs_uri(v))


class ComputeSpec(_Model):
    """Where one stage runs."""

    launcher: Literal["local", "vertex", "gke"] = "local"
    machine_type: str | None = Field(None, description="e.g. ct5lp-hightpu-4t (Vertex) or a node pool machine")
    tpu_topology: str | None = Field(None, description="e.g. 4x4")
    hosts: int = Field(1, ge=1, description="processes (TPU hosts) the stage runs on")
    image: str | None = Field(None, description="container image (vertex, gke)")
    region: str | None = None
    service_account: str | None = None
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for the step")

    @model_validator(mode="after")
    def _remote_needs(self) -> ComputeSpec:
        missing = []
        if self.launcher != "local":
            missing = [k for k in ("image", "machine_type") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"launcher {self.launcher!r} needs {' and '.join(missing)}; set them")
        if self.launcher == "local" and self.hosts != 1:
            raise ValueError("the local launcher runs one process; set hosts: 1 or use launcher vertex/gke")
        return self


class ParamSpec(_Model):
    """A setting a person may change when triggering a run from the UI."""

    path: str = Field(description="dotted key of the setting, e.g. training.steps")
    description: str | None = None
    minimum: int | float | None = None
    maximum: int | float | None = None
    enum: list[Any] | None = None


ScheduleSpec = Annotated[
    str | dict[str, str] | None,
    Field(description="null (manual), a cron expression or preset, or {asset: gs://...}"),
]


class PipelineSpec(_Model):
    name: str = Field(description="pipeline name: lowercase letters, digits, dashes; the DAG id")
    description: str = Field("", description="shown in the Airflow UI")
    schedule: ScheduleSpec = None
    artifact_root: GsUri = Field(description="gs:// prefix under which every run writes")
    base_model: BaseModelSpec
    data: DataSpec
    lora: LoraSpec = LoraSpec()
    training: TrainingSpec = TrainingSpec()
    evaluation: EvaluationSpec = EvaluationSpec()
    gate: GateSpec = GateSpec()
    publish: PublishSpec = PublishSpec()
    compute: dict[str, ComputeSpec] = Field(default_factory=dict, description="per stage (or 'default') where it runs")
    params: list[ParamSpec] = Field(default_factory=list, description="settings overridable at trigger time")
    tags: list[str] = Field(default_factory=list, description="extra Airflow DAG tags (loraflow is always one)")

    _uris = field_validator("artifact_root")(_gs_uri)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid name; use lowercase letters, digits and dashes (max 63)")
        return v

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, v: str | dict[str, str] | None) -> str | dict[str, str] | None:
        if v is None:
            return v
        if isinstance(v, dict):
            if set(v) != {"asset"}:
                raise ValueError("an asset schedule is {asset: gs://BUCKET/PATH}")
            return {"asset": _gs_uri(v["asset"])}
        if v in _CRON_PRESETS:
            return v
        fields = v.split()
        if len(fields) != 5 or not all(_CRON_FIELD.match(f) for f in fields):
            raise ValueError(f"{v!r} is not a cron expression; write five fields like '0 3 * * 1' or @daily")
        return v

    @field_validator("compute")
    @classmethod
    def _compute_stages(cls, v: dict[str, ComputeSpec]) -> dict[str, ComputeSpec]:
        unknown = sorted(set(v) - set(STAGES) - {"default"})
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; use 'default' or one of {list(STAGES)}")
        return v

    @model_validator(mode="after")
    def _params_resolve(self) -> PipelineSpec:
        problems = []
        seen = set()
        for p in self.params:
            if p.path in seen:
                problems.append(f"{p.path} is listed twice")
            seen.add(p.path)
            try:
                value = get_path(self, p.path)
            except KeyError:
                problems.append(f"{p.path} is not a setting of the spec; use a dotted key such as training.steps")
                continue
            if isinstance(value, (dict, list, BaseModel)):
                problems.append(f"{p.path} is a section, not a single setting")
            if p.path.split(".")[0] in {"name", "artifact_root", "compute", "params", "schedule"}:
                problems.append(f"{p.path} cannot be overridden at trigger time")
        if problems:
            raise ValueError("params: " + "; ".join(problems))
        return self

    def compute_for(self, stage: str) -> ComputeSpec:
        return self.compute.get(stage) or self.compute.get("default") or ComputeSpec()

    @property
    def tokenizer_uri(self) -> str:
        return self.base_model.tokenizer or self.base_model.hf_checkpoint

    @property
    def registry_uri(self) -> str:
        return self.publish.registry or f"{self.artifact_root}/_registry"


# --------------------------------------------------------------------------------- dotted paths


def get_path(spec: BaseModel, path: str) -> Any:
    node: Any = spec
    for part in path.split("."):
        if isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        else:
            raise KeyError(path)
    return node


def param_name(path: str) -> str:
    """The Airflow Param name of a dotted setting: ``training.steps`` -> ``training_steps``."""
    return path.replace(".", "_")


def with_overrides(spec: PipelineSpec, overrides: dict[str, Any], source: str = "trigger parameters") -> PipelineSpec:
    """Apply ``{dotted.path: value}`` and validate the result as a whole spec."""
    data = spec.model_dump(mode="json")
    for path, value in overrides.items():
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return validate_spec(data, source)


# ----------------------------------------------------------------------------------- validation


def _fix_hint(err: dict[str, Any]) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        return "unknown key; remove it or check its spelling against docs/spec-reference.md"
    if kind == "missing":
        return "required; add it"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"{msg.lower()} (got {err.get('input')!r})"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "literal_error":
        return f"{msg} (got {err.get('input')!r})"
    return f"{msg} (got {err.get('input')!r})"


def _error_path(loc: tuple[Any, ...]) -> str:
    # Drop pydantic's union-branch labels such as 'str' or 'dict[str,str]' and function names.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in {"str", "int", "float", "bool"}))]
    return ".".join(p for p in parts if not p.startswith("function-")) or "(top level)"


def validate_spec(data: Any, source: str) -> PipelineSpec:
    if not isinstance(data, dict):
        raise SpecError(source, [("(top level)", "a spec is a YAML mapping of keys such as name, base_model, data")])
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as exc:
        problems: dict[tuple[str, str], None] = {}
        for err in exc.errors():
            problems[(_error_path(err["loc"]), _fix_hint(dict(err)))] = None
        raise SpecError(source, list(problems)) from None


def load_spec(path: str | Path) -> PipelineSpec:
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_YAML_LOADER)
    except FileNotFoundError:
        raise SpecError(str(path), [("(file)", "does not exist")]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(yaml)"
        raise SpecError(str(path), [(where, f"not valid YAML: {getattr(exc, 'problem', exc)}")]) from None
    spec = validate_spec(data, str(path))
    if spec.name != path.stem:
        raise SpecError(str(path), [("name", f"is {spec.name!r} but the file is {path.name}; make them match")])
    return spec


def discover(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.yaml"))
