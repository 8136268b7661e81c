"""The pipeline spec: schema, loading, and validation that reports every error at once.

A spec is one YAML file in ``pipelines/``. ``load_spec(path)`` returns a ``PipelineSpec`` or raises
``SpecError`` listing every problem as ``key.path: what is wrong; what to write instead``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import AfterValidator, BaseModel, Field, ValidationError, field_validator, model_validator

from loraflow import models
from loraflow.data import chat_template
from loraflow.errors import EXCERPT_CHARS, SpecError, excerpt
from loraflow.evaluation import guard as guard_sets
from loraflow.evaluation import metrics as metric_table
from loraflow.evaluation import suites as suite_rules
from loraflow.spec import override_rules
from loraflow.spec import resource_names as rn
from loraflow.spec import tuning as tuning_rules
from loraflow.spec.compute import LAUNCHER_NAMES, AnyCompute, ComputeSpec, LocalCompute, serving_build_problems
from loraflow.spec.expectations import MOVED as MOVED_DATA_KEYS
from loraflow.spec.expectations import RULES as EXPECTATION_RULES
from loraflow.spec.expectations import DataExpectations, moved_keys_message
from loraflow.spec.fields import Image, ProjectId, Region, SecretName, Tag, Text, check_name, number_problems
from loraflow.spec.fields import SpecModel as _Model
from loraflow.spec.reader import load_yaml, read_spec_file
from loraflow.spec.stages import STAGE_TABLE, STAGES

# data.train/data.eval of a hand-off spec before a run picks its dataset version (loraflow/pipeline/handoff.py).
HANDOFF_VERSION = "{version}"
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # whole names only: fullmatch (a `$` lets "\n" through)
_CRON_PRESETS = {"@once", "@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@annually"}
GCS_OBJECT_NAME_MAX_BYTES = 1024  # Google Cloud Storage's limit


def _gs_uri(value: str) -> str:
    if not value.startswith("gs://") or len(value) <= len("gs://") or value[5] == "/":
        raise ValueError(f"{value!r} is not a GCS URI; write gs://BUCKET/PATH")
    bucket, _, path = value[5:].partition("/")
    rn.check_bucket(bucket)
    if ".." in value.split("/"):
        raise ValueError(f"{value!r} contains '..'; write the full path without parent references")
    if re.search(r"[\x00-\x1f\x7f]", value):
        raise ValueError(f"{value!r} contains a control character; write the path without it")
    if "." in path.split("/") or "//" in path.rstrip("/") or path.startswith("/"):  # gs://B//x: object "/x"
        raise ValueError(f"{value!r} has an empty or '.' path segment; write gs://BUCKET/PATH with plain segments")
    if len(path.encode()) > GCS_OBJECT_NAME_MAX_BYTES:
        raise ValueError(
            f"gs://{bucket}/... has a path of {len(path.encode())} bytes; GCS object names are at most "
            f"{GCS_OBJECT_NAME_MAX_BYTES} bytes: shorten it"
        )
    return value.rstrip("/")


# Cron as Airflow's timetables read it (croniter), in its common form only: five fields of numbers,
# names, *, ranges, steps and lists. croniter's extensions (L, W, #, ?) are refused, and so is a
# day that no month listed has (the 31st of February), which Airflow takes and never runs.
_CRON_UNITS: tuple[tuple[str, int, int, tuple[str, ...]], ...] = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")),
    ("day of week", 0, 7, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")),
)
_DAYS_IN_MONTH = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)  # February's 29th comes every 4 years


def _cron_values(field: str, unit: tuple[str, int, int, tuple[str, ...]]) -> set[int]:
    """The values a cron field stands for; ValueError naming the part it cannot read."""
    name, lowest, highest, names = unit

    def value(token: str) -> int:
        if token.isdigit() and token.isascii():
            if not lowest <= int(token) <= highest:
                raise ValueError(f"{name} {token} is outside {lowest}-{highest}")
            return int(token)
        if token.upper() in names:
            return names.index(token.upper()) + (lowest if name == "month" else 0)
        spelled = f" or a name ({names[0]}-{names[-1]})" if names else ""
        raise ValueError(f"{name} {token!r} is not a number from {lowest} to {highest}{spelled}")

    values: set[int] = set()
    for item in field.split(","):
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not (step_text.isdigit() and step_text.isascii() and 1 <= int(step_text) <= highest - lowest + 1):
                raise ValueError(
                    f"step {step_text!r} in {name} {item!r} is not a number from 1 to {highest - lowest + 1}"
                )
            step = int(step_text)
        if base == "*":
            first, last = lowest, highest
        else:
            start, dash, end = base.partition("-")
            first = value(start)
            last = value(end) if dash else (highest if slash else first)
            if last < first:
                raise ValueError(f"{name} range {base!r} runs backwards; write it from the lower to the higher value")
        values.update(range(first, last + 1, step))
    return values


def _cron_problem(expression: str) -> str | None:
    fields = expression.split()
    if len(fields) != len(_CRON_UNITS):
        return "write five fields like '0 3 * * 1' or @daily"
    try:
        _, _, days, months, weekdays = (_cron_values(f, u) for f, u in zip(fields, _CRON_UNITS, strict=True))
    except ValueError as exc:
        return f"{exc}; write five fields like '0 3 * * 1' or @daily"
    if {d % 7 for d in weekdays} != set(range(7)):
        return None  # runs on the days of the week it lists (or on the days of the month it lists too)
    if min(days) > max(_DAYS_IN_MONTH[m - 1] for m in months):
        return "never fires: no month it lists has that day; fix the day of month or the month"
    return None


GsUri = Annotated[str, Field(description="a gs://BUCKET/PATH URI")]


class BaseModelSpec(_Model):
    """The model being tuned."""

    hf_checkpoint: GsUri = Field(description="Hugging Face checkpoint directory (config, safetensors, tokenizer)")
    maxtext_model: str = Field(description="MaxText model name, e.g. llama3.1-8b")
    tokenizer: GsUri | None = Field(None, description="tokenizer directory; defaults to hf_checkpoint")
    model_overrides: dict[str, int | float | str | bool] = Field(
        default_factory=dict,
        description="MaxText settings to override, from an allow-list: the model family's shape keys (e.g. the tiny "
        "model's dimensions) and a few tuning knobs (remat_policy, attention, sharding, ...), each value checked: "
        "loraflow/spec/override_rules.py ALLOWED",
    )

    _uris = field_validator("hf_checkpoint", "tokenizer")(lambda v: v if v is None else _gs_uri(v))

    @field_validator("maxtext_model")
    @classmethod
    def _supported_family(cls, v: str) -> str:
        models.family_for(v)  # a ValueError naming the supported models (loraflow/models/)
        return v

    @field_validator("model_overrides")
    @classmethod
    def _allowed_overrides(cls, v: dict[str, int | float | str | bool]) -> dict[str, int | float | str | bool]:
        bad = {k: why for k, val in v.items() if (why := override_rules.problem(k, val))}
        if bad:
            raise ValueError(
                "; ".join(f"{excerpt(k) if len(k) > EXCERPT_CHARS else k}: {why}" for k, why in bad.items())
                + ". model_overrides become MaxText key=value arguments and may set the model's shape and a few "
                f"tuning knobs, each with its reason and values in loraflow/spec/override_rules.py (ALLOWED: "
                f"{', '.join(override_rules.ALLOWED)}); {override_rules.ASK}"
            )
        return v


class DataSpec(_Model):
    """The training data, the eval set, and the data contract."""

    train: GsUri = Field(description="training dataset: one JSONL or Parquet file (prompt/completion or messages)")
    eval: GsUri = Field(description="held-out eval set, same formats")
    expectations: DataExpectations = Field(
        default_factory=DataExpectations,
        description="the data contract: rules " + ", ".join(EXPECTATION_RULES) + ", each {level: fail|warn, "
        "...thresholds} (see loraflow/spec/expectations.py)",
    )

    chat_template: str = Field(
        "auto",
        max_length=65536,
        description="how conversations become model text, the same in training, evaluation and the report "
        "(loraflow/data/chat_template.py): auto (the tokenizer's own template, plain text when it has none), "
        "tokenizer (its own; an error when it has none), tokenizer:NAME (one of its named templates), none "
        "(plain text: BOS, the turns as written, EOS after each answer) or an inline Jinja chat template",
    )

    _uris = field_validator("train", "eval")(_gs_uri)
    _template = field_validator("chat_template")(lambda v: chat_template.check_setting(v))

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        moved = [k for k in MOVED_DATA_KEYS if isinstance(data, dict) and k in data]
        if moved:
            raise ValueError(moved_keys_message(moved))
        return data


class LoraSpec(_Model):
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r")
    target_modules: list[str] | None = Field(
        None, description="regexes over MaxText parameter paths; null = MaxText's default (all projections)"
    )
    quantization: Literal["none", "int8", "int4", "nf4", "float8_e4m3fn"] = Field(
        "none",
        description="QLoRA: while training, the base weights of the kernels LoRA targets are held in this type "
        "(qwix); the adapter is merged into the full-precision base (docs/qlora.md); none = LoRA",
    )
    tile_size: int | None = Field(
        None,
        ge=1,
        description="QLoRA: one scale per tile of this many weights along each kernel's contracted dimension, "
        "which it must divide (checked against the model); null = one scale per output channel",
    )
    quantized_eval_examples: int = Field(
        100,
        ge=0,
        description="QLoRA: how many eval examples (the first) lora_sft answers with the model as it trained "
        "(quantized base + adapter, greedy, evaluation.max_new_tokens), so the report shows what merging into "
        "the full-precision base changed; 0 = none",
    )

    @field_validator("quantization", mode="before")
    @classmethod
    def _qtype_name(cls, v: Any) -> Any:
        if isinstance(v, str) and v.lower() == "fp8":
            raise ValueError("'fp8' is not a type qwix knows; write float8_e4m3fn")
        return v

    @model_validator(mode="after")
    def _tile_needs_quantization(self) -> LoraSpec:
        if self.tile_size is not None and self.quantization == "none":
            raise ValueError("tile_size applies to QLoRA only; set quantization (e.g. nf4) or remove tile_size")
        return self


class TrainingSpec(_Model):
    steps: int = Field(100, ge=1, description="optimizer steps")
    batch_size: int = Field(8, ge=1, description="global batch size (examples per step)")
    learning_rate: float = Field(1e-4, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(512, ge=8, description="tokens per packed training sequence")
    seed: int = Field(0, ge=0, description="data order and initialisation seed")
    checkpoint_period: int = Field(50, ge=1, description="save an Orbax checkpoint every N steps (and at the end)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="compute and weight dtype: activations, frozen base, LoRA factors, Adam's moments"
    )
    checkpoint_storage: Literal["staged", "direct"] = Field(
        "staged",
        description="where Orbax writes checkpoints: staged (every host writes its own shards to its own disk and "
        "uploads them to the stage's gs://.../_checkpoints/<step>/host-<i>; a step is committed once every host "
        "uploaded; a resume needs the same number of hosts) or direct (Orbax writes gs://.../_checkpoints itself, "
        "every host its own shards)",
    )
    tuning: Literal["off", "auto"] = Field(
        "off",
        description="off (MaxText's defaults) or auto: lora_sft trains with the remat policy that keeps the most of "
        "the forward pass for the backward (so recomputes least) among those predicted to fit the chip, else "
        "MaxText's full (loraflow/spec/tuning.py; docs/production.md, 'Faster: training.tuning'). The results are "
        "the same either way, only speed and memory differ; auto is part of lora_sft's config (it changes the "
        "compiled program), so setting it moves the spec's training cache key, and so would making it the "
        "default for every spec that leaves it out. Refused beside base_model.model_overrides.remat_policy",
    )


class SuiteSpec(_Model):
    """A standard benchmark (an lm-evaluation-harness task) both evaluations score (docs/architecture.md).

    It runs in the evaluate step's own engine, with the eval set's chat template ("Standard benchmarks")."""

    name: Annotated[str, AfterValidator(suite_rules.check_name)] = Field(
        description="the suite's label in metrics.json, the report and gate.guard.suite"
    )
    task: Annotated[str, AfterValidator(suite_rules.check_task)] = Field(
        description="the lm-eval task: one lm-eval ships (gsm8k, arc_easy, ...: its data is fetched from the "
        "Hugging Face hub, so the serving host needs network) or, with source, the task its YAML defines"
    )
    source: str | None = Field(
        None,
        description="a gs:// folder staged beforehand holding <task>.yaml (lm-eval's task format, no !function) "
        "and its data files (json, csv or parquet, named relative to the YAML); nothing is downloaded at run time",
    )
    metric: Annotated[str, AfterValidator(suite_rules.check_metric)] = Field(
        description="the figure reported and guarded, as lm-eval names it: METRIC,FILTER "
        "(exact_match,strict-match for gsm8k; acc,none for a multiple-choice task)"
    )
    limit: int | None = Field(None, ge=1, description="score only the task's first N documents; null = all")

    # a folder: its listing must not take in a neighbour whose name starts alike (gs://b/suites/gsm8k_cot/)
    _uri = field_validator("source")(lambda v: v if v is None else _gs_uri(v) + "/")


class EvaluationSpec(_Model):
    max_new_tokens: int = Field(16, ge=1, le=4096)
    batch_size: int = Field(64, ge=1)
    seed: int = Field(0, ge=0)
    answer_pattern: str = Field(r"^\s*([^\s<]+)", description="regex; group 1 is the answer compared to the reference")
    max_examples: int | None = Field(None, ge=1, description="evaluate only the first N examples")
    max_model_len: int = Field(1024, ge=16)
    answer_format: Literal["pattern", "tagged"] = Field(
        "pattern",
        description="where the answer is read: pattern (answer_pattern's group 1) or tagged (the "
        "<answer>...</answer> tags of <reasoning>...</reasoning><answer>...</answer>; a reference holding "
        "<answer> tags is then compared by their content)",
    )
    relative_tolerance: float = Field(
        0.1,
        ge=0,
        le=1,
        description="approx_accuracy's tolerance: |answer - reference| <= this * |reference| (last numbers)",
    )
    metrics: list[Annotated[str, AfterValidator(metric_table.check_name)]] = Field(
        default_factory=lambda: ["accuracy", "format_rate"],
        min_length=1,
        description="the metrics the evaluate stages score (gate.metric is always scored too), of: "
        + ", ".join(metric_table.METRICS),
        json_schema_extra={"items": {"enum": list(metric_table.METRICS)}},
    )

    suites: list[SuiteSpec] = Field(
        default_factory=list,
        description="standard benchmarks (lm-evaluation-harness tasks) both evaluations score in the same engine: "
        "[{name, task, source, metric, limit}]; [] = none",
    )

    @field_validator("metrics")
    @classmethod
    def _metrics_once(cls, v: list[str]) -> list[str]:
        return metric_table.check_names(v)

    @field_validator("suites")
    @classmethod
    def _suites_once(cls, v: list[SuiteSpec]) -> list[SuiteSpec]:
        names = [suite.name for suite in v]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"suite name(s) {', '.join(twice)} listed twice; give each suite its own name")
        return v

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


class GuardSpec(_Model):
    """The regression guard: both evaluations also score a general multiple-choice set (docs/architecture.md).

    The gate refuses a tuned model whose accuracy on it fell more than ``max_drop`` below the base's."""

    set: str | None = Field(
        None,
        description="the guard set (or suite, not both): a shipped one ("
        + "; ".join(f"`{name}`: {what}" for name, what in guard_sets.SHIPPED.items())
        + ") or a gs:// URI of your own JSONL of {id, question, choices: [2-10 options], answer: index} rows",
    )
    suite: str | None = Field(
        None,
        description="guard on a standard benchmark instead of a set: the name of one of evaluation.suites, "
        "whose metric is right/wrong per document (exact_match, acc)",
    )
    max_drop: float = Field(
        0.05,
        ge=0,
        description="the most the guard accuracy may fall from base to tuned, as a share from 0 to 1 (0.05 = 5 points)",
    )
    rule: Literal["estimate", "interval"] = Field(
        "estimate",
        description="estimate: refuse when the measured drop (base - tuned) exceeds max_drop; interval: also "
        "refuse unless the paired bootstrap interval (gate.confidence) shows the drop is at most max_drop "
        "(its lower bound of tuned - base >= -max_drop; needs a large guard set)",
    )

    @field_validator("set")
    @classmethod
    def _set(cls, v: str | None) -> str | None:
        if v is None:
            return v
        return _gs_uri(v) if v.startswith("gs://") else guard_sets.check_setting(v)

    @model_validator(mode="after")
    def _set_or_suite(self) -> GuardSpec:
        if (self.set is None) == (self.suite is None):
            raise ValueError("name either set (a guard set) or suite (one of evaluation.suites), not both or neither")
        return self

    @field_validator("max_drop")
    @classmethod
    def _share(cls, v: float) -> float:
        if v > 1:
            raise ValueError(f"is a share of the questions, 0 to 1, not points: write {v / 100:g} for {v:g} points")
        return v


class GateSpec(_Model):
    metric: Annotated[str, AfterValidator(metric_table.check_name)] = Field(
        "accuracy",
        description="the metric the gate compares (loraflow/evaluation/metrics.py), one of: "
        + metric_table.described(),
        json_schema_extra={"enum": list(metric_table.METRICS)},
    )
    min_improvement: float = Field(0.0, ge=-1, le=1, description="tuned - base must reach at least this")
    confidence: float = Field(0.95, gt=0.5, lt=1)
    bootstrap_samples: int = Field(2000, ge=100)
    guard: GuardSpec | None = Field(
        None,
        description="a regression guard: {set or suite, max_drop, rule}; both evaluations score the set (or the "
        "suite) and the gate refuses a tuned model that fell more than max_drop below the base on it; null = none",
    )


class VertexModelRegistrySpec(_Model):
    """Also register each promoted model in Vertex AI Model Registry (one model per pipeline, a
    version per promotion, the ``champion`` alias mirroring the GCS registry's)."""

    project: ProjectId | None = Field(
        None, description="GCP project id; default LORAFLOW_VERTEX_PROJECT or GOOGLE_CLOUD_PROJECT"
    )
    region: Region = Field("us-central1", description="Vertex AI region of the registry, e.g. us-central1")
    display_name: Annotated[str, AfterValidator(lambda v: check_name(v, 128, "display name"))] | None = Field(
        None, description="the model's display name; default the pipeline's name"
    )
    serving_container_image: Image = Field(description="container image that serves the merged model (e.g. vLLM)")
    serving_container_args: list[str] = Field(default_factory=list, description="arguments of the serving container")
    labels: dict[str, str] = Field(default_factory=dict, description="extra labels on every version")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k, val in v.items() if not _LABEL.fullmatch(k) or not _LABEL_VALUE.fullmatch(val)]
        if bad:
            raise ValueError(
                f"label(s) {bad} are not Vertex AI labels; use lowercase letters, digits, '-' and '_' (max 63)"
            )
        return v


_LABEL = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")


class VertexTrackingSpec(_Model):
    """Log each run to Vertex AI Experiments, its curves to the experiment's Vertex AI TensorBoard."""

    tensorboard: Annotated[str, AfterValidator(rn.check_tensorboard)] = Field(
        description="the TensorBoard instance backing the experiment, projects/P/locations/REGION/tensorboards/ID; "
        "the experiment lives in its project and region"
    )
    experiment: Annotated[str, AfterValidator(rn.check_experiment)] = Field(
        description="the Vertex AI experiment (made on first use); each pipeline run is one of its runs"
    )

    @property
    def project(self) -> str:
        return self.tensorboard.split("/")[1]

    @property
    def region(self) -> str:
        return self.tensorboard.split("/")[3]


class TrackingSpec(_Model):
    vertex: VertexTrackingSpec | None = Field(
        None,
        description="{tensorboard, experiment}: the report task logs the run's parameters, metrics and curves "
        "(lora_sft's and the evaluations' tensorboard/ scalars) to Vertex AI Experiments; null = not logged",
    )


class PublishSpec(_Model):
    registry: GsUri | None = Field(None, description="registry prefix; default {artifact_root}/_registry")
    vertex_model_registry: VertexModelRegistrySpec | None = Field(
        None, description="also register promoted models in Vertex AI Model Registry"
    )

    _uris = field_validator("registry")(lambda v: v if v is None else _gs_uri(v))


class RetrySpec(_Model):
    """How Airflow retries a stage whose step program crashed (killed host, OOM, lost connection).

    A step that refuses its input (bad data, a bad spec) fails at once: retrying cannot help.
    A retry never redoes committed work (a committed stage is reused; lora_sft resumes from its
    newest checkpoint in GCS)."""

    retries: int = Field(2, ge=0, le=10, description="retries per task after its first try")
    delay_seconds: float = Field(30, ge=0, le=3600, description="wait before the first retry")
    backoff: float = Field(2.0, ge=1, le=10, description="each further retry waits this many times longer")
    max_delay_seconds: float = Field(600, ge=0, le=86400, description="longest wait between two tries")


_SECRET_FIELD = re.compile(r"password|login|host|extra\.[A-Za-z0-9_.-]+")


class SecretSpec(_Model):
    """A secret a step program needs (an HF token, a service-account key), named, never written down.

    The spec holds the Airflow connection id; the value is read from Airflow's connections (or its
    secrets backend) when the task runs, masked in the task log, and handed to the step program
    only as an environment variable."""

    connection: str = Field(description="Airflow connection id holding the secret, e.g. huggingface_default")
    field: str = Field("password", description="which part of the connection: password, login, host or extra.KEY")
    stages: list[str] | None = Field(None, description="stages that receive it; null = every stage")

    @field_validator("connection")
    @classmethod
    def _conn_id(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,250}", v):
            raise ValueError(f"{v!r} is not a connection id; use letters, digits, '_', '.', '-'")
        return v

    @field_validator("field")
    @classmethod
    def _field(cls, v: str) -> str:
        if not _SECRET_FIELD.fullmatch(v):
            raise ValueError(f"{v!r} is not a connection field; use password, login, host or extra.KEY")
        return v

    @field_validator("stages")
    @classmethod
    def _stages(cls, v: list[str] | None) -> list[str] | None:
        unknown = sorted(set(v or []) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; use stages of {list(STAGES)}")
        return v


class ParamSpec(_Model):
    """A setting a person may change when triggering a run from the UI."""

    path: str = Field(description="dotted key of the setting, e.g. training.steps")
    description: Text | None = None
    minimum: int | float | None = None
    maximum: int | float | None = None
    enum: list[Any] | None = None


class HandoffSpec(_Model):
    """Where a data team hands over dataset versions (see docs/data-handoff.md).

    Each version is a folder ``{prefix}/{version}/`` holding the train and eval files and, written
    last, a ``_READY`` marker. A run takes one version and writes ``_RESULT.json`` beside it."""

    prefix: GsUri = Field(description="gs:// folder whose subfolders are dataset versions")
    train: str = Field("train.jsonl", description="training file name inside a version folder")
    eval: str = Field("eval.jsonl", description="eval file name inside a version folder")

    _uris = field_validator("prefix")(_gs_uri)

    @field_validator("train", "eval")
    @classmethod
    def _file_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v) or v.startswith("_"):
            raise ValueError(f"{v!r} is not a file name; write a plain name such as train.jsonl (no folders)")
        return v


NotifyEvent = Literal["failure", "promotion", "verdict"]
NOTIFY_EVENTS: tuple[NotifyEvent, ...] = ("failure", "promotion", "verdict")


class NotifySpec(_Model):
    """Where failure and promotion notices go (Airflow notifiers, operators/notifiers.py)."""

    kind: Literal["file", "webhook"] = Field(
        description="file: append one JSON line per notice; webhook: POST JSON to an Airflow HTTP connection"
    )
    path: str | None = Field(None, description="file: the absolute path of the file on the Airflow workers")
    connection: str | None = Field(None, description="webhook: the Airflow connection id holding the URL (host)")
    events: list[NotifyEvent] = Field(
        default_factory=lambda: list(NOTIFY_EVENTS),
        description="which notices: failure (a task failed), promotion (a model was promoted), verdict (hand-off)",
    )

    @model_validator(mode="after")
    def _target(self) -> NotifySpec:
        if self.kind == "file" and not (self.path and self.path.startswith("/")):
            raise ValueError("a file notifier needs path: an absolute file path, e.g. /var/log/loraflow/notices.jsonl")
        if self.kind == "webhook" and not (self.connection and re.fullmatch(r"[A-Za-z0-9_.-]{1,250}", self.connection)):
            raise ValueError(
                "a webhook notifier needs connection: the id of an Airflow HTTP connection holding the URL"
            )
        return self


ScheduleSpec = Annotated[
    str | dict[str, str] | None,
    Field(description="null (manual), a cron expression or preset, or {asset: gs://...}"),
]


# Sections a trigger-time param may not override.
_FIXED_AT_TRIGGER = {"name", "artifact_root", "compute", "params", "schedule", "retry", "secrets", "handoff", "notify"}


class PipelineSpec(_Model):
    name: str = Field(description="pipeline name: lowercase letters, digits, dashes; the DAG id")
    description: Text = Field("", description="shown in the Airflow UI")
    schedule: ScheduleSpec = None
    artifact_root: GsUri = Field(description="gs:// prefix under which every run writes")
    base_model: BaseModelSpec
    data: DataSpec
    lora: LoraSpec = LoraSpec()
    training: TrainingSpec = TrainingSpec()
    evaluation: EvaluationSpec = EvaluationSpec()
    gate: GateSpec = GateSpec()
    publish: PublishSpec = PublishSpec()
    tracking: TrackingSpec = TrackingSpec()
    compute: dict[str, ComputeSpec] = Field(default_factory=dict, description="per stage (or 'default') where it runs")
    retry: RetrySpec = RetrySpec()
    secrets: dict[SecretName, SecretSpec] = Field(
        default_factory=dict, description="environment variable name -> the Airflow connection holding its value"
    )
    handoff: HandoffSpec | None = Field(
        None,
        description="take the dataset from a data team's hand-off: {prefix: gs://..., train, eval} "
        "(docs/data-handoff.md)",
    )
    notify: list[NotifySpec] = Field(
        default_factory=list,
        description="notifiers: [{kind: file, path} | {kind: webhook, connection}, events: "
        "[failure, promotion, verdict]] (docs/data-handoff.md)",
    )
    params: list[ParamSpec] = Field(default_factory=list, description="settings overridable at trigger time")
    tags: list[Tag] = Field(
        default_factory=list, description="extra Airflow DAG tags (loraflow is always one), each 1-100 characters"
    )

    _uris = field_validator("artifact_root")(_gs_uri)

    @model_validator(mode="before")
    @classmethod
    def _handoff_dataset(cls, data: Any) -> Any:
        """With a hand-off, data.train/data.eval name the files inside the version a run picks."""
        if not isinstance(data, dict) or not isinstance(data.get("handoff"), dict):
            return data
        prefix = str(data["handoff"].get("prefix", "")).rstrip("/")
        section = dict(data.get("data") or {})
        for split in ("train", "eval"):
            name = data["handoff"].get(split, f"{split}.jsonl")
            given = section.get(split)
            if given is None:
                section[split] = f"{prefix}/{HANDOFF_VERSION}/{name}"
            elif not (
                isinstance(given, str)
                and given.startswith(prefix + "/")
                and given.endswith("/" + str(name))
                and given[len(prefix) + 1 : -len(str(name)) - 1].count("/") == 0
            ):
                raise ValueError(
                    f"data.{split} is taken from the hand-off ({prefix}/{HANDOFF_VERSION}/{name}); remove data.{split}"
                )
        return {**data, "data": section}

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
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
        if problem := _cron_problem(v):
            raise ValueError(f"{v!r} is not a cron expression Airflow runs: {problem}")
        return v

    @field_validator("compute")
    @classmethod
    def _compute_stages(cls, v: dict[str, AnyCompute]) -> dict[str, AnyCompute]:
        unknown = sorted(set(v) - set(STAGES) - {"default"})
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; use 'default' or one of {list(STAGES)}")
        return v

    @field_validator("compute")
    @classmethod
    def _serving_builds(cls, v: dict[str, AnyCompute]) -> dict[str, AnyCompute]:
        """An evaluate stage's image is the vLLM build of its machine (``serving_build``, docs/production.md)."""
        problems = serving_build_problems(v, [stage.name for stage in STAGE_TABLE if stage.env == "serving"])
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _guard_suite_is_scored(self) -> PipelineSpec:
        guard = self.gate.guard
        names = [suite.name for suite in self.evaluation.suites]
        if guard is not None and guard.suite is not None and guard.suite not in names:
            raise ValueError(
                f"gate.guard.suite {guard.suite!r} is not one of evaluation.suites ({', '.join(names) or 'none'}); "
                "add the suite there or name one of them"
            )
        return self

    @model_validator(mode="after")
    def _tuning_chooses_remat(self) -> PipelineSpec:
        problem = tuning_rules.conflict(self.training.tuning, self.base_model.model_overrides)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _tile_fits_the_model(self) -> PipelineSpec:
        tile = self.lora.tile_size
        if tile is None:
            return self
        family = models.family_for(self.base_model.maxtext_model)
        dims = family.contracted_dims(self.base_model.maxtext_model, self.base_model.model_overrides)
        misfits = [f"{name} {size} ({kernels})" for name, (size, kernels) in dims.items() if size % tile]
        if misfits:
            fits = [t for t in (256, 128, 64, 32, 16) if all(size % t == 0 for size, _ in dims.values())]
            raise ValueError(
                f"lora.tile_size {tile} must divide the dimension each quantized kernel contracts over, but not "
                f"{'; '.join(misfits)}; set lora.tile_size to "
                + (f"one that divides them all, e.g. {fits[0]}" if fits else "null (one scale per channel)")
            )
        return self

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
                continue
            problems.extend(_param_default_problems(p, value))
            if p.path.split(".")[0] in _FIXED_AT_TRIGGER:
                problems.append(f"{p.path} cannot be overridden at trigger time")
        if problems:
            raise ValueError("params: " + "; ".join(problems))
        return self

    def compute_for(self, stage: str) -> AnyCompute:
        """Where ``stage`` runs: its own ``compute`` entry, else ``default``, else the local launcher."""
        return self.compute.get(stage) or self.compute.get("default") or LocalCompute()

    @property
    def tokenizer_uri(self) -> str:
        return self.base_model.tokenizer or self.base_model.hf_checkpoint

    @property
    def registry_uri(self) -> str:
        return self.publish.registry or f"{self.artifact_root}/_registry"


def _json_equal(a: Any, b: Any) -> bool:
    """Equal as JSON Schema's ``enum`` compares: true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def _param_default_problems(p: ParamSpec, value: Any) -> list[str]:
    """The spec's own value is the trigger form's default: it must pass the param's bounds and choices
    (Airflow refuses to schedule a DAG whose Param defaults do not, and the form would start invalid)."""
    out = []
    if p.minimum is not None and p.maximum is not None and p.minimum > p.maximum:
        out.append(f"{p.path}: its minimum {p.minimum} is above its maximum {p.maximum}; swap them")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if p.minimum is not None and value < p.minimum:
            out.append(f"{p.path}: the spec's value {value} is below its minimum {p.minimum}; lower the minimum")
        if p.maximum is not None and value > p.maximum:
            out.append(f"{p.path}: the spec's value {value} is above its maximum {p.maximum}; raise the maximum")
    if p.enum is not None and not any(_json_equal(value, choice) for choice in p.enum):
        out.append(f"{p.path}: the spec's value {value!r} is not one of its enum {p.enum}; add it to the enum")
    return out


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


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _json_type(spec: PipelineSpec, path: str) -> str | list[str]:
    """The JSON type of a setting's trigger field: its value's; for a setting without a value (null),
    its declared type or null (a scheduled DAG's Param defaults must pass their own schema)."""
    default = get_path(spec, path)
    if default is not None:
        return _JSON_TYPES.get(type(default), "string")
    *parents, leaf = path.split(".")
    section = get_path(spec, ".".join(parents)) if parents else spec
    kinds = [
        get_args(a)[0] if get_origin(a) is Annotated else a
        for a in get_args(type(section).model_fields[leaf].annotation)
    ]
    declared = [_JSON_TYPES[k] for k in kinds if k in _JSON_TYPES]
    return ["null", declared[0] if declared else "string"]


def trigger_fields(spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    """The spec's overridable settings as trigger-form fields, by Param name: the current value
    (``default``), ``title``, ``description`` and the JSON schema (type, bounds, choices)."""
    fields = {}
    for p in spec.params:
        default = get_path(spec, p.path)
        schema: dict[str, Any] = {"type": _json_type(spec, p.path)}
        if p.minimum is not None:
            schema["minimum"] = p.minimum
        if p.maximum is not None:
            schema["maximum"] = p.maximum
        if p.enum is not None:
            schema["enum"] = p.enum
        bounds = ", ".join(f"{k} {schema[k]}" for k in ("minimum", "maximum") if k in schema)
        description = (p.description or f"overrides {p.path}") + (f" ({bounds})" if bounds else "")
        fields[param_name(p.path)] = {"default": default, "title": p.path, "description": description, **schema}
    return fields


def check_trigger_keys(spec: PipelineSpec, keys: Iterable[str]) -> None:
    """Refuse trigger parameters (a run's conf keys) that are no declared param of the spec, naming
    each and the nearest declared one: Airflow passes an unknown conf key on silently, and a typo
    such as ``training_step`` would otherwise train with the defaults."""
    declared = sorted(param_name(p.path) for p in spec.params)
    unknown = sorted(set(keys) - set(declared))
    if not unknown:
        return
    listed = ", ".join(declared) if declared else "none: this pipeline declares no params"
    problems = []
    for key in unknown:
        near = (
            []
            if len(key) > EXCERPT_CHARS
            else (
                difflib.get_close_matches(key, declared, n=1)
                or difflib.get_close_matches(param_name(key), declared, n=1)
            )
        )
        hint = f"did you mean {near[0]}? " if near else ""
        problems.append(
            (key if len(key) <= EXCERPT_CHARS else excerpt(key),
             f"is not a trigger parameter of this pipeline; {hint}Trigger parameters: {listed}. "
             "Remove the key from the run's conf, or declare its setting under params in the spec")
        )  # fmt: skip
    raise SpecError(f"pipeline {spec.name}", problems, where=TRIGGER_PARAMETERS)


TRIGGER_PARAMETERS = "the run's trigger parameters (its conf)"
_JSON_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
                    "null": "null"}  # fmt: skip


def _json_types(value: Any) -> set[str]:
    """The JSON Schema types ``value`` has: true is no number, 2.0 is an integer (as Airflow's Param checks)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"integer", "number"} if value.is_integer() else {"number"}
    return {"string"} if isinstance(value, str) else {"array or object"}


def _trigger_value_problem(field: dict[str, Any], value: Any) -> str | None:
    """Why ``value`` breaks its trigger field's schema (type, minimum, maximum, enum), or None."""
    types = field["type"] if isinstance(field["type"], list) else [field["type"]]
    if not _json_types(value) & set(types):
        return "is not " + " or ".join(_JSON_TYPE_WORDS[t] for t in types)
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in field and value < field["minimum"]:
            return f"is below its minimum {field['minimum']}"
        if "maximum" in field and value > field["maximum"]:
            return f"is above its maximum {field['maximum']}"
    if "enum" in field and not any(_json_equal(value, choice) for choice in field["enum"]):
        return f"is not one of its enum ({', '.join(excerpt(c) for c in field['enum'])})"
    return None


def check_trigger_values(spec: PipelineSpec, params: Mapping[str, Any]) -> None:
    """Refuse a declared param's value that breaks its declaration (type, minimum, maximum, enum), as
    Airflow's Param schema does on a trigger, naming each key, the rule and the setting: a task can
    run with values Airflow never checked (a direct call, a DAG parsed from an older spec), and the
    spec's own validation would take ``true`` for 1 and ``"200"`` for 200."""
    fields = trigger_fields(spec)
    problems = [
        (name, f"{excerpt(value)} {why} ({fields[name]['title']}); give a value its param allows")
        for name, value in params.items()
        if name in fields and (why := _trigger_value_problem(fields[name], value))
    ]
    if problems:
        raise SpecError(f"pipeline {spec.name}", problems, where=TRIGGER_PARAMETERS)


def with_overrides(spec: PipelineSpec, overrides: dict[str, Any], source: str = "trigger parameters") -> PipelineSpec:
    """Apply ``{dotted.path: value}`` and validate the result as a whole spec."""
    data = spec.model_dump(mode="json")
    for path, value in overrides.items():
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = _as_json_schema_reads(spec, path, value)
    return validate_spec(data, source)


def _as_json_schema_reads(spec: PipelineSpec, path: str, value: Any) -> Any:
    """A trigger value as its param's JSON Schema reads it: 2000.0 is the integer 2000 for an
    integer setting (the spec itself, strict, takes only 2000 there)."""
    integer = "integer" in _json_type(spec, path)
    if integer and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# ----------------------------------------------------------------------------------- validation


def _launcher_tag(loc: tuple[Any, ...]) -> str | None:
    """The launcher whose keys an error under ``compute.<stage>`` is about (pydantic puts the union's tag there)."""
    if len(loc) > 2 and loc[0] == "compute" and loc[2] in LAUNCHER_NAMES:
        return str(loc[2])
    return None


def _fix_hint(err: dict[str, Any]) -> str:
    kind, msg = err["type"], err["msg"]
    launcher = _launcher_tag(tuple(err.get("loc", ())))
    if kind == "extra_forbidden" and launcher is not None:
        return (
            f"not a key of the {launcher} launcher; remove it, or see the {launcher} launcher's keys "
            "in docs/spec-reference.md"
        )
    if kind == "extra_forbidden":
        return "unknown key; remove it or check its spelling against docs/spec-reference.md"
    if kind == "unknown_launcher":
        given = err.get("input")
        return f"{msg} (got {_given(given.get('launcher') if isinstance(given, dict) else given)})"
    if kind == "missing":
        return "required; add it"
    if kind in _NUMBER_TYPES and isinstance(err.get("input"), bool | str):
        return _not_a_number(msg, err["input"], _NUMBER_TYPES[kind])
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"{msg.lower()} (got {_given(err.get('input'))})"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    return f"{msg} (got {_given(err.get('input'))})"


# pydantic's error types for a value that is no number, and the number each setting wants.
_NUMBER_TYPES = {"int_type": "a whole number such as 100", "float_type": "a number such as 0.05"}


def _not_a_number(msg: str, given: bool | str, wanted: str) -> str:
    """Why ``true`` or text is no number of a spec (``msg``: pydantic's), and what to write."""
    if isinstance(given, bool):
        why = "YAML reads true, false, yes, no, on and off as booleans"
        return f"{msg.lower()} (got {given}): {why}; write {wanted}"
    return f"{msg.lower()} (got {_given(given)}): text is no number; write {wanted}, without quotes"


def _given(value: Any) -> str:
    """A refused value as an error shows it (Python's repr), at most its first characters and its length."""
    if isinstance(value, str):
        return excerpt(value)
    text = repr(value)
    return text if len(text) <= EXCERPT_CHARS else f"{text[:EXCERPT_CHARS]}... ({len(text)} characters)"


def _error_path(loc: tuple[Any, ...]) -> str:
    # Drop pydantic's union-branch labels such as 'str' or 'dict[str,str]', function names and the
    # compute section's launcher tags.
    if _launcher_tag(loc) is not None:
        loc = loc[:2] + loc[3:]
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in {"str", "int", "float", "bool"}))]
    return ".".join(p for p in parts if not p.startswith("function-")) or "(top level)"


# pydantic's errors that a refused number (not finite, too large) makes as well: the number check says why.
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def validate_spec(data: Any, source: str) -> PipelineSpec:
    """``data`` (a spec as plain data) as a ``PipelineSpec``, or ``SpecError`` listing every problem.

    Every number, wherever it sits, is checked by one rule (``fields.number_problems``) in the data
    as written, with the other problems; a setting takes no text for a number (the models are strict),
    so the validated spec holds no number the data did not."""
    if not isinstance(data, dict):
        raise SpecError(source, [("(top level)", "a spec is a YAML mapping of keys such as name, base_model, data")])
    numbers = number_problems(data)
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as exc:
        problems: dict[tuple[str, str], None] = dict.fromkeys(numbers)
        refused = {key for key, _ in numbers}
        for err in exc.errors():
            key = _error_path(err["loc"]) + (".launcher" if err["type"] == "unknown_launcher" else "")
            if key in refused and err["type"] in _BOUND_ERRORS:
                continue
            problems[(key, _fix_hint(dict(err)))] = None
        raise SpecError(source, list(problems)) from None
    if numbers:
        raise SpecError(source, numbers)
    return spec


def load_spec(path: str | Path) -> PipelineSpec:
    path = Path(path)
    return parse_spec(read_spec_file(path), path)


def parse_spec(text: bytes | str, path: Path) -> PipelineSpec:
    """The spec in ``text``, the contents of the spec file ``path`` (its name must be the spec's);
    size, aliases and nesting are bounded (loraflow/spec/reader.py)."""
    spec = validate_spec(load_yaml(text, str(path)), str(path))
    if spec.name != path.stem:
        raise SpecError(str(path), [("name", f"is {spec.name!r} but the file is {path.name}; make them match")])
    return spec
