"""``compute.<stage>``: where one stage runs. One config class per launcher, told apart by ``launcher``.

Each class holds exactly the keys its launcher reads (``loraflow/launchers/<name>.py``), so a Vertex AI
key under a GKE stage is refused as unknown instead of being silently ignored. A class's ``launcher``
``Literal`` is the one place its name is written: a new launcher adds its class here and to
``AnyCompute``; the names, the tagged union the schema validates and its error follow from them
(``loraflow/launchers/registry.py`` maps each class to its code).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping
from functools import reduce
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import AfterValidator, Discriminator, Field, Tag, model_validator

from loraflow.spec import env_rules, machines
from loraflow.spec import resource_names as rn
from loraflow.spec.fields import EnvValue, Image, Region, SpecModel, StepEnvName

_LAUNCHER_HELP = "where the stage runs; each launcher takes only its own keys, below"


class _Compute(SpecModel):
    launcher: str = Field(description=_LAUNCHER_HELP)
    hosts: int = Field(1, ge=1, description="processes (TPU hosts) the stage runs on")
    env: Annotated[dict[StepEnvName, EnvValue], AfterValidator(env_rules.check_step_env)] = Field(
        default_factory=dict,
        description="extra environment variables for the step, from an allow-list of tuning variables (XLA_FLAGS "
        "and LIBTPU_INIT_ARGS with allowed flags only, JAX_PLATFORMS, log levels, ...), each value checked: "
        "loraflow/spec/env_rules.py ALLOWED",
    )


class LocalCompute(_Compute):
    """The step program runs as a child process of the Airflow worker, in its environment's interpreter."""

    launcher: Literal["local"] = Field("local", description=_LAUNCHER_HELP)

    @model_validator(mode="after")
    def _one_process(self) -> LocalCompute:
        if self.hosts != 1:
            remote = "/".join(launcher_name(config) for config in COMPUTE_CLASSES if issubclass(config, _RemoteCompute))
            raise ValueError(f"the local launcher runs one process; set hosts: 1 or use launcher {remote}")
        return self


class _RemoteCompute(_Compute):
    """What every launcher that runs the step in a container image on cloud machines needs."""

    machine_type: Annotated[str, AfterValidator(rn.check_machine_type)] | None = Field(
        None, description="e.g. ct5lp-hightpu-4t (Vertex) or a node pool machine"
    )
    tpu_topology: Annotated[str, AfterValidator(rn.check_tpu_topology)] | None = Field(None, description="e.g. 4x4")
    image: Image | None = Field(None, description="container image")
    service_account: Annotated[str, AfterValidator(rn.check_service_account)] | None = Field(
        None,
        description="the job's Google service account email (its project is the job's, unless the workers name one)",
    )
    deferrable: bool = Field(
        True, description="wait for the job in Airflow's triggerer, freeing the worker slot (false: a worker polls)"
    )
    serving_build: machines.ServingBuild | None = Field(
        None,
        description="evaluate_base / evaluate_tuned (or default): which vLLM build the image is, cpu (the default), tpu "
        "or cuda, as docker/serving.Dockerfile's SERVING_BUILD made it; it must be the machine's (a TPU machine tpu, a "
        "GPU machine cuda, any other cpu), and an image tag ending in -cpu, -tpu or -cuda must say the same "
        "(docs/production.md)",
    )

    @model_validator(mode="after")
    def _image_and_machine(self) -> _RemoteCompute:
        missing = [k for k in ("image", "machine_type") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"launcher {getattr(self, 'launcher', '?')!r} needs {' and '.join(missing)}; set them")
        return self


class VertexCompute(_RemoteCompute):
    """A Vertex AI CustomJob (loraflow/launchers/vertex.py)."""

    launcher: Literal["vertex"] = Field(description=_LAUNCHER_HELP)
    region: Region | None = Field(None, description="Google Cloud region of the job, e.g. us-central1")
    network: Annotated[str, AfterValidator(rn.check_network)] | None = Field(
        None, description="VPC network to peer the job with, projects/PROJECT_NUMBER/global/networks/NAME"
    )
    reserved_ip_ranges: list[Annotated[str, AfterValidator(rn.check_gce_name)]] = Field(
        default_factory=list, description="names of reserved IP ranges in that network for the job"
    )
    reservation: str | None = Field(None, description="consume this reservation, projects/P/zones/Z/reservations/NAME")
    spot: bool = Field(False, description="run on Spot capacity (cheaper, preemptible)")

    @model_validator(mode="after")
    def _vertex_options(self) -> VertexCompute:
        if self.reserved_ip_ranges and not self.network:
            raise ValueError("reserved_ip_ranges need a network; set network or remove reserved_ip_ranges")
        if self.reservation and self.spot:
            raise ValueError("Spot capacity cannot consume a reservation; set spot: false or remove reservation")
        if self.reservation is not None and not rn.RESERVATION.fullmatch(self.reservation):
            raise ValueError(f"reservation {self.reservation!r} is not projects/PROJECT/zones/ZONE/reservations/NAME")
        return self


class GkeCompute(_RemoteCompute):
    """A JobSet on a GKE cluster (loraflow/launchers/gke.py)."""

    launcher: Literal["gke"] = Field(description=_LAUNCHER_HELP)
    namespace: Annotated[str, AfterValidator(rn.check_k8s_label)] | None = Field(
        None, description="Kubernetes namespace of the JobSet (default: default)"
    )
    kubernetes_service_account: Annotated[str, AfterValidator(rn.check_k8s_subdomain)] | None = Field(
        None, description="the pods' Kubernetes service account (Workload Identity maps it to a Google one)"
    )
    node_pool: Annotated[str, AfterValidator(rn.check_k8s_label)] | None = Field(
        None, description="run only on this node pool (cloud.google.com/gke-nodepool)"
    )


RemoteCompute = VertexCompute | GkeCompute
AnyCompute = LocalCompute | VertexCompute | GkeCompute  # every launcher's config, in the order the docs list them
COMPUTE_CLASSES: tuple[type[_Compute], ...] = get_args(AnyCompute)


def launcher_name(config: type[_Compute]) -> str:
    """The ``launcher`` value that picks ``config``: the one value of its ``Literal``."""
    (name,) = get_args(config.model_fields["launcher"].annotation)
    return str(name)


LAUNCHER_NAMES = tuple(launcher_name(config) for config in COMPUTE_CLASSES)
DEFAULT_LAUNCHER = str(LocalCompute.model_fields["launcher"].default)


def _launcher_of(value: Any) -> str:
    """The tag of a compute entry: its ``launcher`` (default local). An unknown name is left to pydantic,
    whose error lists the known ones."""
    launcher = (
        value.get("launcher", DEFAULT_LAUNCHER)
        if isinstance(value, dict)
        else getattr(value, "launcher", DEFAULT_LAUNCHER)
    )
    return str(launcher)


def _quoted_choice(names: tuple[str, ...]) -> str:
    quoted = [repr(name) for name in names]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"


if TYPE_CHECKING:
    ComputeSpec = AnyCompute
else:  # each config tagged with its launcher's name, told apart by ``_launcher_of``
    ComputeSpec = Annotated[
        reduce(operator.or_, (Annotated[config, Tag(launcher_name(config))] for config in COMPUTE_CLASSES)),
        Discriminator(
            _launcher_of,
            custom_error_type="unknown_launcher",
            custom_error_message=f"unknown launcher; use {_quoted_choice(LAUNCHER_NAMES)}",
        ),
    ]


def tagged_build(image: str) -> machines.ServingBuild | None:
    """The serving build an image reference's tag names (``serving:0.1.0-tpu`` -> tpu), None when it names none."""
    tag = image.split("@")[0].split("/")[-1].partition(":")[2]
    return next((build for build in machines.SERVING_BUILDS if tag.endswith(f"-{build}")), None)


def serving_build_problem(key: str, compute: AnyCompute) -> str | None:
    """Why an evaluate stage's compute entry ``compute.<key>`` cannot serve: its image's vLLM build
    (``serving_build``, default cpu) is not the one its machine needs, or its tag names another; else None."""
    if isinstance(compute, LocalCompute):
        return None  # the worker's own serving environment: the CPU build
    machine, image = str(compute.machine_type), str(compute.image)  # a remote entry has both
    build = compute.serving_build or "cpu"
    tagged = tagged_build(image)
    if tagged is not None and tagged != build:
        return (
            f"compute.{key}: the image {image} is tagged as the {tagged} serving build but serving_build is "
            f"{build}; set compute.{key}.serving_build: {tagged}, or name the image of the {build} build"
        )
    needed = machines.serving_build_for(machine)
    if build == needed:
        return None
    unset = "" if compute.serving_build else " (serving_build unset)"
    return (
        f"compute.{key}: {machine} carries {machines.carries(machine)} but the image is the {build} serving "
        f"build{unset}, whose vLLM runs on {machines.RUNS_ON[build]}; set compute.{key}.serving_build: {needed} "
        f"and image to one built with --build-arg SERVING_BUILD={needed} (docs/production.md)"
    )


def serving_build_problems(entries: Mapping[str, AnyCompute], serving_stages: Collection[str]) -> list[str]:
    """Every problem of the spec's ``compute`` section with serving builds: an evaluate stage whose
    entry (its own, else ``default``) does not pair its machine with its vLLM build, and
    ``serving_build`` on a stage that runs no serving image."""
    problems = []
    for stage in serving_stages:
        key = stage if stage in entries else "default"
        problem = serving_build_problem(key, entries[key]) if key in entries else None
        if problem:
            problems.append(problem)
    for key, compute in entries.items():
        if key not in serving_stages and key != "default" and getattr(compute, "serving_build", None):
            problems.append(
                f"compute.{key}.serving_build: {key} runs no serving image (only {' and '.join(serving_stages)} "
                "do); remove it"
            )
    return list(dict.fromkeys(problems))  # both evaluate stages on default: said once


def compute_from(**keys: Any) -> AnyCompute:
    """A compute entry from its keys as a spec writes them (``launcher`` picks the class), validated."""
    from pydantic import TypeAdapter

    compute: AnyCompute = TypeAdapter(ComputeSpec).validate_python(keys)
    return compute
