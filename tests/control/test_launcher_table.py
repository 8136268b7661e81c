"""A launcher is one row: its config class names it (``loraflow/spec/compute.py``), its launcher class
names that config, its trigger and what ``loraflow plan`` shows (``loraflow/launchers/registry.py``)."""

from __future__ import annotations

from loraflow.spec.compute import LAUNCHER_NAMES, compute_from
from loraflow.spec.reference import render


def test_the_spec_reference_names_every_launcher_and_the_default() -> None:
    intro = next(line for line in render().splitlines() if line.startswith("Its `launcher`"))
    assert intro.startswith("Its `launcher` (`local`, `vertex`, `gke`; default `local`) decides which keys")
    assert LAUNCHER_NAMES == ("local", "vertex", "gke")


def test_an_entry_without_a_launcher_is_local() -> None:
    assert compute_from(hosts=1).launcher == "local"
