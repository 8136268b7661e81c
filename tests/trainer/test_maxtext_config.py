"""loraflow.trainer.maxtext_config: MaxText's config is built without turning on XLA's HLO dumps.

MaxText's config validation sets ``XLA_FLAGS`` to dump every ``jit_train_step`` XLA compiles into the host's
``/tmp/xla_dump/`` where the variable is unset, whatever ``dump_hlo`` says; loraflow's stages must not leave
those files behind, nor lose a value a deployer set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.trainer import maxtext_config
from loraflow.trainer.maxtext_config import NEUTRAL, hlo_dumps_off, sft_config

ARGV = ["loraflow-test", "model_name=llama3.1-8b", "hardware=cpu", "skip_jax_distributed_system=true"]

# A fresh process (XLA reads XLA_FLAGS once, when its first backend starts): MaxText's config of ARGV with
# its dump folder pointed at argv[2], then a jitted function named train_step, as MaxText's step is; prints
# XLA_FLAGS as the config left it.
CHILD = """
import json, os, sys
import jax
from loraflow.trainer.maxtext_config import sft_config
from maxtext.configs import pyconfig
argv = json.loads(sys.argv[1]) + [f"dump_hlo_local_dir={sys.argv[2]}/"]
config = sft_config(argv) if sys.argv[3] == "loraflow" else pyconfig.initialize_pydantic(argv)
left = os.environ.get("XLA_FLAGS")
def train_step(x):
    return x * 2.0
jax.jit(train_step)(jax.numpy.ones(4)).block_until_ready()
print("LEFT " + json.dumps(left))
"""


def _child(dump: Path, how: str) -> str | None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    # compiled in each child, not read from the session's cache: a program read from it is dumped in part only
    env |= {"JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(ARGV), str(dump), how],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("LEFT "))
    return json.loads(line[len("LEFT ") :])


def test_a_stage_s_config_leaves_no_hlo_dump_and_no_xla_flags_behind(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "loraflow", tmp_path / "maxtext"
    assert _child(ours, "loraflow") is None
    assert not ours.exists() or not any(ours.iterdir()), sorted(p.name for p in ours.iterdir())
    # what the guard is for: MaxText's own config of the same argv dumps the step (if this fails, MaxText
    # stopped doing it and maxtext_config can go)
    left = _child(theirs, "maxtext")
    assert left is not None and f"--xla_dump_to={theirs}/" in left
    dumped = sorted(p.name for p in theirs.iterdir())
    assert any(".jit_train_step." in name for name in dumped), dumped


def test_a_config_keeps_what_a_deployer_set(monkeypatch: pytest.MonkeyPatch) -> None:
    set_by_deployer = "--xla_force_host_platform_device_count=2"
    monkeypatch.setenv("XLA_FLAGS", set_by_deployer)
    config = sft_config(list(ARGV))
    assert os.environ["XLA_FLAGS"] == set_by_deployer and config.model_name == "llama3.1-8b"


@pytest.mark.parametrize("before", [None, ""])
def test_the_flags_are_neutral_inside_and_as_they_were_after(
    monkeypatch: pytest.MonkeyPatch, before: str | None
) -> None:
    if before is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", before)
    seen: list[str | None] = []
    with hlo_dumps_off():
        seen.append(os.environ.get("XLA_FLAGS"))
    assert seen == [NEUTRAL] and os.environ.get("XLA_FLAGS") == before
    with pytest.raises(RuntimeError), hlo_dumps_off():
        raise RuntimeError("a config that failed")
    assert os.environ.get("XLA_FLAGS") == before


def test_the_neutral_flag_is_the_default_of_a_flag_deployers_may_set() -> None:
    from loraflow.spec import env_rules

    assert maxtext_config.NEUTRAL == "--xla_force_host_platform_device_count=1"
    assert env_rules.value_problem("XLA_FLAGS", NEUTRAL) is None
