"""The pipeline's stages, each declared once: everything that differs from one stage to the next.

The planner (``loraflow.pipeline.plan.stage_plans``) iterates this table, the spec schema takes its
stage names from it (``STAGES``), ``loraflow.spec.step_configs.STEP_CONFIGS`` resolves each stage's
config class from it and ``operators/stages.py`` builds one operator class per row from it (the
operator traits below). Adding a stage is a row here, its step program and its config class
(docs/architecture.md, "Adding a stage").

Light on purpose: the standard library only, so the spec schema and the DAG file import it without
the planner, pydantic's models or Airflow. Hence names, not objects, for what lives above it: the
environment (``loraflow.launchers.environments.ENVIRONMENTS``), the step program's module and the
config class (in ``loraflow.spec.step_configs``, which itself imports the schema).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from loraflow.spec.schema import PipelineSpec


@dataclass(frozen=True)
class Source:
    """An input that is not a loraflow artifact: a dataset, a Hugging Face checkpoint."""

    uri: str


@dataclass(frozen=True)
class Upstream:
    """An input that is another stage's committed output (its manifest)."""

    stage: str
    fetch: bool = True  # False: only referenced (fingerprinted, not downloaded)
    optional: bool = False  # True: the stage runs without it when that stage failed or was skipped


Input = Source | Upstream

# The files a stage writes that another stage, a notice, the hand-off or a user reads by name: each name is
# written here once and read from here; each stage's row lists its own (``outputs``; a test pins that).
DATA_REPORT = "data_report.json"  # validate_data: every expectation's finding (also under _rejected/)
LOSS_CSV = "loss.csv"  # lora_sft: one row per logged step
QUANTIZED_ANSWERS = "quantized_answers.jsonl"  # lora_sft under QLoRA: the quantized model's own answers
METRICS_JSON = "metrics.json"  # evaluate_base / evaluate_tuned: the scores and the scoring settings
PREDICTIONS_JSONL = "predictions.jsonl"  # evaluate_*: each example's prompt, answer, reference and scores
PREDICTIONS_PARQUET = "predictions.parquet"  # evaluate_*: the same rows, as the gate reads them
DECISION = "decision.json"  # gate: the verdict (storage.summaries.GateSummary) and its evidence
REGISTRY_ENTRY = "registry_entry.json"  # publish: the version registered, or why none was
REPORT_HTML = "report.html"  # report: the run report
EnvironmentName = Literal["control", "trainer", "serving"]
TriggerRule = Literal["all_success", "all_done"]
# The operator's extra links (operators/links.py): the task's buttons in the Airflow UI.
Link = Literal["data_docs", "workload", "artifacts", "report", "experiment"]


@dataclass(frozen=True)
class Stage:
    """One stage: its step program, where it runs, what it reads, how it is cached and ordered, and
    how its Airflow task looks."""

    name: str
    env: EnvironmentName
    module: str  # the step program: python -m MODULE
    inputs: Callable[[PipelineSpec], dict[str, Input]]  # input name -> where it comes from, for a spec
    config: str  # its config class in loraflow.spec.step_configs (from_spec builds it, wire() is sent)
    cacheable: bool = True
    after: tuple[str, ...] = ()  # stages it runs after beyond those its inputs name
    reported: bool = True  # the run report reads its output (an optional input of the report)
    # The Airflow operator (operators/stages.py builds it; its class is operator_name).
    ui_color: str = "#e8f0fe"
    trigger_rule: TriggerRule = "all_success"
    links: tuple[Link, ...] = ("workload", "artifacts")
    # What its output carries in OpenLineage (loraflow/pipeline/lineage.py): its summary, as facet loraflow_<this>.
    lineage_facet: str = "summary"
    outputs: tuple[str, ...] = ()  # the files of its artifact read by name elsewhere (the names above)

    def upstream(self, spec: PipelineSpec) -> tuple[str, ...]:
        """The stages it runs after: those its inputs name, then those it lists in ``after``."""
        named = [i.stage for i in self.inputs(spec).values() if isinstance(i, Upstream)]
        return tuple(dict.fromkeys([*named, *self.after]))

    @property
    def operator_name(self) -> str:
        """The operator's class name in ``operators.stages``: ``lora_sft`` -> ``LoraSftOperator``."""
        return "".join(part.capitalize() for part in self.name.split("_")) + "Operator"


def suite_input(suite_name: str) -> str:
    """The evaluate step's input that carries a staged suite's folder (``evaluation.suites``): ``suite_<name>``."""
    return "suite_" + suite_name


def _evaluate_inputs(spec: PipelineSpec, model: Input) -> dict[str, Input]:
    """An evaluation's inputs: the model, the eval set, when gate.guard names its own file the guard set, and
    each staged suite's folder (``suite_<name>``)."""
    inputs: dict[str, Input] = {"model": model, "eval_set": Upstream("validate_data")}
    guard = spec.gate.guard
    if guard is not None and guard.set is not None and guard.set.startswith("gs://"):
        inputs["guard_set"] = Source(guard.set)
    for suite in spec.evaluation.suites:
        if suite.source is not None:
            inputs[suite_input(suite.name)] = Source(suite.source)
    return inputs


def _report_inputs(spec: PipelineSpec) -> dict[str, Input]:
    # Every input optional: the report also describes a run where a stage failed.
    return {stage: Upstream(stage, fetch=False, optional=True) for stage in REPORTED}


# In pipeline order: each stage after every stage it reads or runs after (a test holds it).
STAGE_TABLE: tuple[Stage, ...] = (
    Stage(
        "validate_data",
        "control",
        "loraflow.steps.validate_data",
        lambda spec: {
            "train": Source(spec.data.train),
            "eval": Source(spec.data.eval),
            "tokenizer": Source(spec.tokenizer_uri),
        },
        "ValidateDataConfig",
        links=("data_docs", "workload", "artifacts"),
        lineage_facet="data_contract",
        outputs=(DATA_REPORT,),
    ),
    Stage(
        "convert_checkpoint",
        "trainer",
        "loraflow.steps.convert_checkpoint",
        lambda spec: {"hf_checkpoint": Source(spec.base_model.hf_checkpoint)},
        "ConvertCheckpointConfig",
        # Nothing is converted or trained before the data contract holds.
        after=("validate_data",),
    ),
    Stage(
        "evaluate_base",
        "serving",
        "loraflow.steps.evaluate",
        lambda spec: _evaluate_inputs(spec, Source(spec.base_model.hf_checkpoint)),
        "EvaluateConfig",
        lineage_facet="evaluation",
        outputs=(METRICS_JSON, PREDICTIONS_JSONL, PREDICTIONS_PARQUET),
    ),
    Stage(
        "lora_sft",
        "trainer",
        "loraflow.steps.lora_sft",
        lambda spec: {
            "checkpoint": Upstream("convert_checkpoint"),
            "dataset": Upstream("validate_data"),
            "tokenizer": Source(spec.tokenizer_uri),
        },
        "LoraSftConfig",
        ui_color="#fce8e6",
        lineage_facet="training",
        outputs=(LOSS_CSV, QUANTIZED_ANSWERS),
    ),
    Stage(
        "merge_adapter",
        "trainer",
        "loraflow.steps.merge_adapter",
        lambda spec: {"base": Source(spec.base_model.hf_checkpoint), "adapter": Upstream("lora_sft")},
        "MergeAdapterConfig",
    ),
    Stage(
        "evaluate_tuned",
        "serving",
        "loraflow.steps.evaluate",
        lambda spec: _evaluate_inputs(spec, Upstream("merge_adapter")),
        "EvaluateConfig",
        lineage_facet="evaluation",
        outputs=(METRICS_JSON, PREDICTIONS_JSONL, PREDICTIONS_PARQUET),
    ),
    Stage(
        "gate",
        "control",
        "loraflow.steps.gate",
        lambda spec: {"base_eval": Upstream("evaluate_base"), "tuned_eval": Upstream("evaluate_tuned")},
        "GateConfig",
        # It also compares with the registry's current champion, which moves between runs
        # without any input changing: a cached decision could promote a model the champion beats.
        cacheable=False,
        lineage_facet="gate_decision",
        outputs=(DECISION,),
    ),
    Stage(
        "publish",
        "control",
        "loraflow.steps.publish",
        lambda spec: {"model": Upstream("merge_adapter", fetch=False), "decision": Upstream("gate")},
        "PublishConfig",
        cacheable=False,
        # The report reads the publish outcome from the run's prefix: publish is skipped when the
        # gate does not promote, and a skipped upstream is no input.
        reported=False,
        lineage_facet="publication",
        outputs=(REGISTRY_ENTRY,),
    ),
    Stage(
        "report",
        "control",
        "loraflow.steps.report",
        _report_inputs,
        "ReportConfig",
        cacheable=False,  # it reports this run: its cache hits, its publish outcome
        # The report follows publish (and reads its outcome from the run's prefix) without
        # needing it: publish is skipped when the gate does not promote.
        after=("publish",),
        reported=False,  # itself
        ui_color="#e6f4ea",
        # Every run gets its report: one the gate did not promote, one in which a stage failed.
        trigger_rule="all_done",
        links=("report", "experiment", "artifacts"),
        outputs=(REPORT_HTML,),
    ),
)

STAGES: tuple[str, ...] = tuple(stage.name for stage in STAGE_TABLE)
BY_NAME: dict[str, Stage] = {stage.name: stage for stage in STAGE_TABLE}
# The stages the run report reads (by reference: it fetches only the few small files it shows).
REPORTED: tuple[str, ...] = tuple(stage.name for stage in STAGE_TABLE if stage.reported)
