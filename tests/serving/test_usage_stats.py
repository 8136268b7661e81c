"""vLLM, as a step runs it, sends no usage statistics (issue 29, item 4): the step environment every
launcher builds turns them off, and vLLM reads it so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraflow.launchers.local import step_environment


def usage_stats_enabled(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> bool:
    """What vLLM decides in a process whose environment is ``env`` (its decision is cached: reset)."""
    from vllm import envs
    from vllm.usage import usage_lib

    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    monkeypatch.setattr(usage_lib, "_USAGE_STATS_ENABLED", None)
    return bool(usage_lib.is_usage_stats_enabled())


def test_a_step_environment_turns_vllm_usage_statistics_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no do_not_track file of the user's
    env = step_environment()
    assert usage_stats_enabled(env, monkeypatch) is False
    without = {k: v for k, v in env.items() if k not in {"VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"}}
    assert usage_stats_enabled(without, monkeypatch) is True  # the variables are what turns them off
