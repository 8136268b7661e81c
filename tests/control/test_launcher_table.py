"""A launcher is one row: its config class names it (``loraflow/spec/compute.py``), its launcher class
names that config, its trigger and what ``loraflow plan`` shows (``loraflow/launchers/registry.py``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from loraflow.cli import main
from loraflow.launchers.base import RemoteLauncher
from loraflow.launchers.registry import LAUNCHERS
from loraflow.spec.compute import COMPUTE_CLASSES, LAUNCHER_NAMES, compute_from, launcher_name
from loraflow.spec.reference import render

REPO = Path(__file__).resolve().parents[2]
TPU = {"image": "us-docker.pkg.dev/p/r/trainer:1", "machine_type": "ct5lp-hightpu-4t", "tpu_topology": "2x2"}
REMOTE = {"vertex": {"launcher": "vertex", **TPU}, "gke": {"launcher": "gke", **TPU, "namespace": "ml"}}


def test_the_spec_reference_names_every_launcher_and_the_default() -> None:
    intro = next(line for line in render().splitlines() if line.startswith("Its `launcher`"))
    assert intro.startswith("Its `launcher` (`local`, `vertex`, `gke`; default `local`) decides which keys")
    assert LAUNCHER_NAMES == ("local", "vertex", "gke")


def test_an_entry_without_a_launcher_is_local() -> None:
    assert compute_from(hosts=1).launcher == "local"


def test_each_config_class_has_one_launcher_of_its_name() -> None:
    assert list(LAUNCHERS) == list(LAUNCHER_NAMES)
    assert [launcher.config for launcher in LAUNCHERS.values()] == list(COMPUTE_CLASSES)
    assert all(name == launcher_name(launcher.config) for name, launcher in LAUNCHERS.items())


@pytest.mark.parametrize("name", [name for name, cls in LAUNCHERS.items() if issubclass(cls, RemoteLauncher)])
def test_a_remote_launcher_names_its_trigger_by_the_path_the_triggerer_stores(name: str) -> None:
    from operators.triggers import trigger_class

    path = LAUNCHERS[name].trigger
    assert path is not None and trigger_class(name).__module__ == f"operators.triggers.{name}"
    assert LAUNCHERS[name].plan_request is not None
    assert f"{trigger_class(name).__module__}.{trigger_class(name).__qualname__}" == path


def test_the_local_launcher_cannot_defer() -> None:
    from operators.triggers import trigger_class

    with pytest.raises(TypeError, match="the local launcher has no trigger"):
        trigger_class("local")


@pytest.mark.parametrize("name", [name for name, cls in LAUNCHERS.items() if cls.plan_request])
def test_plan_prints_each_remote_request_under_its_title(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = yaml.safe_load((REPO / "pipelines" / "llama31-8b-lora.yaml").read_text())
    raw["compute"]["lora_sft"] = REMOTE[name]
    (tmp_path / "llama31-8b-lora.yaml").write_text(yaml.safe_dump(raw))
    assert main(["plan", str(tmp_path / "llama31-8b-lora.yaml")]) == 0
    request = LAUNCHERS[name].plan_request
    assert request is not None
    stage = capsys.readouterr().out.split("\nlora_sft  (")[1].split("\n\n")[0]
    assert f"\n  {request.title} (not sent; CACHE_KEY and LOCK are filled in at run time):\n  {{\n" in stage
    assert main(["plan", str(tmp_path / "llama31-8b-lora.yaml"), "--json"]) == 0
    [entry] = [s for s in json.loads(capsys.readouterr().out)["stages"] if s["stage"] == "lora_sft"]
    assert entry["launcher"]["launcher"] == name and isinstance(entry[request.key], dict)


UNREACHABLE = {
    "vertex": {"job_name": "projects/p/locations/us-central1/customJobs/1", "endpoint": "http://127.0.0.1:1"},
    "gke": {"namespace": "ml", "name": "lf-x", "endpoint": "http://127.0.0.1:1"},
}


@pytest.mark.parametrize("name", sorted(UNREACHABLE))
def test_a_trigger_is_only_its_watch_and_fires_one_event_when_its_job_cannot_be_read(name: str) -> None:
    from operators.triggers import trigger_class
    from operators.triggers.base import WorkloadTrigger

    cls = trigger_class(name)
    assert issubclass(cls, WorkloadTrigger) and {"run", "serialize", "on_kill"}.isdisjoint(vars(cls))
    trigger = cls(**UNREACHABLE[name], stage="lora_sft", poll_seconds=0.01)

    async def events() -> list[dict[str, Any]]:
        return [dict(event.payload) async for event in trigger.run()]

    [event] = asyncio.run(events())
    assert event["status"] == "error" and event["state"] == "" and event["stage"] == "lora_sft"
    assert event["job_name"] == trigger.workload() and "failed" in event["message"]
    assert trigger.serialize() == (
        LAUNCHERS[name].trigger,
        {**UNREACHABLE[name], "stage": "lora_sft", "poll_seconds": 0.01},
    )


def test_a_local_entry_on_several_hosts_is_told_the_remote_launchers() -> None:
    with pytest.raises(ValueError, match="set hosts: 1 or use launcher vertex/gke"):
        compute_from(launcher="local", hosts=2)
