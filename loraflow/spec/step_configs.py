"""One typed config per step program: built from the spec by the planner, validated by the step.

Each class holds every knob its step honours, and nothing else. Its fields are of two kinds:

* **spec keys**: inherited from the spec's own section models (``loraflow.spec.schema``), so their types,
  bounds, validators and defaults are the spec's, written once. A step run by hand with no config
  behaves like the same step in a pipeline whose spec leaves those keys out.
* **internal knobs** (``INTERNAL``, each with why): not reachable from the spec, never sent by the
  planner (so they are not in any cache key) and fixed at the default given here. They exist for
  tests, benchmarks and people running a step by hand; ``docs/architecture.md`` lists them.

The planner builds ``X.from_spec(spec)`` and sends ``wire()``, the JSON the step receives as
``--config-json`` (and what the cache key hashes). A step calls :func:`parse`: an unknown key is
refused naming it and the known ones, a bad value names its key, a missing key takes the default.

Airflow-free and light: pydantic and the spec models only (every environment imports it).
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraflow.errors import LoraflowError
from loraflow.spec.expectations import DataExpectations
from loraflow.spec.schema import (
    STAGES,
    DataSpec,
    EvaluationSpec,
    GateSpec,
    LoraSpec,
    PipelineSpec,
    TrainingSpec,
    VertexModelRegistrySpec,
    VertexTrackingSpec,
)
from loraflow.spec.stages import STAGE_TABLE

Scalar = int | float | str | bool
Hardware = Literal["tpu", "gpu", "gpu_multiprocess", "cpu"]  # MaxText's hardware values


class StepConfig(BaseModel):
    """What every step config shares: no unknown keys, immutable, the internal knobs named."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    STEP: ClassVar[str] = "step"
    # Knobs the spec cannot reach, each with why: never sent by the planner, default applies.
    INTERNAL: ClassVar[dict[str, str]] = {}

    @classmethod
    @abstractmethod
    def from_spec(cls, spec: PipelineSpec) -> Self:
        """The config a pipeline with this spec sends its step (every step's config class says how)."""

    def wire(self) -> dict[str, Any]:
        """The ``--config-json`` payload: every field but the internal knobs."""
        return self.model_dump(mode="json", exclude=set(self.INTERNAL))


C = TypeVar("C", bound=StepConfig)


def parse(config_cls: type[C], raw: Any) -> C:
    """A step's ``--config-json`` as its config class; every problem named at once."""
    step = config_cls.STEP
    if not isinstance(raw, Mapping):
        raise LoraflowError(f"{step}: --config-json must be a JSON object of settings, got {type(raw).__name__}")
    known = sorted(config_cls.model_fields)
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise LoraflowError(
            f"{step}: unknown config key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}. "
            "Remove or respell them (loraflow plan SPEC prints the config the pipeline sends)"
        )
    try:
        return config_cls.model_validate(dict(raw))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(config)"
            if err["type"] == "missing":
                problems.append(f"{where}: required; add it")
                continue
            what = str(err["msg"]).removeprefix("Value error, ")
            problems.append(f"{where}: {what} (got {err.get('input')!r})")
        raise LoraflowError(f"{step}: invalid config: " + "; ".join(problems)) from None


def spec_field(section: type[BaseModel], name: str) -> Any:
    """The field of spec key ``name`` (default, bounds, description) for a step config: written once."""
    return copy.copy(section.model_fields[name])


class ValidateDataConfig(StepConfig):
    STEP: ClassVar[str] = "validate_data"
    expectations: DataExpectations = spec_field(DataSpec, "expectations")
    # Resolved against the tokenizer here and handed on as chat_template.json: training and both
    # evaluations render with the template this stage recorded (loraflow/data/chat_template.py).
    chat_template: str = spec_field(DataSpec, "chat_template")

    @classmethod
    def from_spec(cls, spec: PipelineSpec) -> ValidateDataConfig:
        return cls(expectations=spec.data.expectations, chat_template=spec.data.chat_template)


def _maxtext_model(spec: PipelineSpec) -> dict[str, Any]:
    """The model as MaxText names it: base_model.maxtext_model and base_model.model_overrides."""
    return {"model_name": spec.base_model.maxtext_model, "model_overrides": dict(spec.base_model.model_overrides)}


class ConvertCheckpointConfig(StepConfig):
    STEP: ClassVar[str] = "convert_checkpoint"
    INTERNAL: ClassVar[dict[str, str]] = {
        "save_dtype": "the converted weights' dtype; float32 keeps the HF weights exactly, training casts",
        "hardware": "MaxText's hardware; chosen from JAX's devices (or LORAFLOW_HARDWARE), a test pins it",
    }
    model_name: str
    model_overrides: dict[str, Scalar] = Field(default_factory=dict)
    # Fixed by loraflow, sent (so part of the key): lora_sft reads the layout back from the checkpoint.
    scan_layers: bool = True
    save_dtype: Literal["float32", "bfloat16"] = "float32"
    hardware: Hardware | None = None

    @classmethod
    def from_spec(cls, spec: PipelineSpec) -> ConvertCheckpointConfig:
        return cls(**_maxtext_model(spec))


class LoraSftConfig(LoraSpec, TrainingSpec, StepConfig):
    STEP: ClassVar[str] = "lora_sft"
    INTERNAL: ClassVar[dict[str, str]] = {
        "warmup_fraction": "share of the steps with a rising learning rate; loraflow's schedule, not the author's",
        "packing": "several examples per row; false only for the multi-host equivalence test (MaxText packs per host)",
        "shuffle": "every epoch in its own order, fixed by the seed (loraflow.data.epochs); false keeps the file order",
        "hardware": "MaxText's hardware; chosen from JAX's devices (or LORAFLOW_HARDWARE), a test pins it",
        "log_every": "how often the task log gets a loss line",
    }
    # null: the converted checkpoint's (the step refuses a model that differs from it)
    model_name: str | None = None
    model_overrides: dict[str, Scalar] | None = None
    warmup_fraction: float = Field(0.05, ge=0, lt=1)
    packing: bool = True
    shuffle: bool = True
    hardware: Hardware | None = None
    log_every: int = Field(10, ge=1)
    # QLoRA: the length of the trained model's answers to the eval prompts (lora.quantized_eval_examples).
    # Sent only under QLoRA, so a LoRA pipeline's training key does not move with its evaluation settings.
    max_new_tokens: int = spec_field(EvaluationSpec, "max_new_tokens")

    @classmethod
    def from_spec(cls, spec: PipelineSpec) -> LoraSftConfig:
        answers: dict[str, Any] = (
            {"max_new_tokens": spec.evaluation.max_new_tokens} if spec.lora.quantization != "none" else {}
        )
        return cls(**_maxtext_model(spec), **spec.lora.model_dump(), **spec.training.model_dump(), **answers)

    def wire(self) -> dict[str, Any]:
        wire = super().wire()
        if wire["tuning"] == "off":
            del wire["tuning"]  # a pipeline without tuning keeps the training key it had before tuning
        return wire


class MergeAdapterConfig(StepConfig):
    STEP: ClassVar[str] = "merge_adapter"
    # Fixed by loraflow, sent: the largest safetensors shard of the merged checkpoint, in MiB.
    shard_size_mb: int | float = Field(500, gt=0)

    @classmethod
    def from_spec(cls, spec: PipelineSpec) -> MergeAdapterConfig:
        return cls()


_ENGINE = "a vLLM engine setting for the serving host, not the experiment; the default suits one device"


class EvaluateConfig(EvaluationSpec, StepConfig):
    STEP: ClassVar[str] = "evaluate"
    INTERNAL: ClassVar[dict[str, str]] = {
        "temperature": "0 = greedy: the gate compares base and tuned example by example, sampling adds noise",
        "tensor_parallel_size": _ENGINE,
        "pipeline_parallel_size": _ENGINE,
        "distributed_executor_backend": _ENGINE + " (null: uni for one device, vLLM's choice otherwise)",
        "enforce_eager": _ENGINE + " (null: true on CPU)",
        "kv_cache_memory_bytes": _ENGINE
        + " (null on CPU: what batch_size sequences of max_model_len tokens fill, at most a quarter of the"
        " memory; vLLM's profiling elsewhere)",
        "gpu_memory_utilization": _ENGINE,
        "engine_args": "any other vllm.LLM keyword arguments; never from the spec (trust_remote_code, paths)",
    }
    # The model is served in the dtype it is trained in (training.dtype).
    dtype: Literal["float32", "bfloat16"] = spec_field(TrainingSpec, "dtype")
    temperature: float = Field(0.0, ge=0)
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    distributed_executor_backend: str | None = None
    enforce_eager: bool | None = None
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # gate.guard.set: the regression guard's set, scored beside the eval set (a shipped name or a gs://
    # URI, which then comes as the guard_set input); null = no guard.
    guard_set: str | None = None

    @classmethod
    def from_spec(cls, spec: PipelineSpec) -> EvaluateConfig:
        evaluation = spec.evaluation.model_dump()
        # The gate's metric is scored whatever evaluation.metrics says: the gate reads its column.
        if spec.gate.metric not in evaluation["metrics"]:
            evaluation["metrics"] = [*evaluation["metrics"], spec.gate.metric]
        guard = spec.gate.guard
        return cls(**evaluation, dtype=spec.training.dtype, guard_set=guard.set if guard else None)

    def wire(self) -> dict[str, Any]:
        wire = super().wire()
        if wire["guard_set"] is None:
            del wire["guard_set"]  # a pipeline without a guard keeps the cache keys it had before guards
        if not wire["suites"]:
            del wire["suites"]  # ... and one without suites those it had before suites
        return wire


class GateConfig(GateSpec, StepConfig):
    STEP: ClassVar[str] = "gate"
    INTERNAL: ClassVar[dict[str, str]] = {
        "seed": "the bootstrap's seed: fixed, so the same evaluations always get the same decision",
    }
    # With pipeline: where this pipeline's champion is registered (both or neither).
    registry_uri: str | None = None
    pipeline: str | None = None
    # Where the champion's model must lie (registry.champion refuses a model anywhere else).
    artifact_root: str | None = None
    seed: int = Field(0, ge=0)

    @classmethod
    def from_spec(cls, spec: PipelineSpec) -> GateConfig:
        return cls(
            **spec.gate.model_dump(),
            registry_uri=spec.registry_uri,
            pipeline=spec.name,
            artifact_root=spec.artifact_root,
        )

    def wire(self) -> dict[str, Any]:
        wire = super().wire()
        guard = wire.get("guard")
        if isinstance(guard, dict):  # a guard names a set or a suite: the other is not sent, so a guard on a
            for key in ("set", "suite"):  # set keeps the gate's cache key it had before suites
                if guard.get(key) is None:
                    del guard[key]
        return wire


class PublishConfig(StepConfig):
    STEP: ClassVar[str] = "publish"
    INTERNAL: ClassVar[dict[str, str]] = {
        "run_id": "the run being published; taken from the output prefix (…/RUN/publish)",
        "model_manifest": "the merged model's manifest when no model input is given (a run by hand)",
    }
    registry_uri: str
    pipeline: str
    vertex_model_registry: VertexModelRegistrySpec | None = None
    run_id: str | None = None
    model_manifest: str | None = None

    @classmethod
    def from_spec(cls, spec: PipelineSpec) -> PublishConfig:
        return cls(
            registry_uri=spec.registry_uri, pipeline=spec.name, vertex_model_registry=spec.publish.vertex_model_registry
        )

    def wire(self) -> dict[str, Any]:
        wire = super().wire()
        if wire["vertex_model_registry"] is None:
            del wire["vertex_model_registry"]  # as the planner always sent it: only when the spec has one
        return wire


class ReportConfig(StepConfig):
    STEP: ClassVar[str] = "report"
    pipeline: str = ""  # the pipeline's name (the report's title)
    # The stages in pipeline order (the table's rows): every stage before the report.
    stages: list[str] = Field(default_factory=lambda: [s for s in STAGES if s != "report"])
    # tracking.vertex: the run logged to Vertex AI Experiments once the page is written; null = not logged.
    vertex_tracking: VertexTrackingSpec | None = None

    @classmethod
    def from_spec(cls, spec: PipelineSpec) -> ReportConfig:
        return cls(pipeline=spec.name, vertex_tracking=spec.tracking.vertex)


# Each stage's config class, as the stage table names it (loraflow/spec/stages.py).
_CLASSES: dict[str, type[StepConfig]] = {cls.__name__: cls for cls in StepConfig.__subclasses__()}
STEP_CONFIGS: dict[str, type[StepConfig]] = {stage.name: _CLASSES[stage.config] for stage in STAGE_TABLE}
