"""The environment variables a spec may set, by class (hypothesis): every family that can take the
step over is refused in any letter case with its rule; every variable loraflow's launchers set
themselves is refused; legitimate tuning passes; the spec reports each refusal at its key."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from loraflow.errors import SpecError
from loraflow.launchers import gke_jobset as gke
from loraflow.launchers import local as launch
from loraflow.launchers import vertex_job as vertex
from loraflow.spec import env_rules
from loraflow.spec.compute import compute_from
from loraflow.spec.schema import validate_spec

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "pipelines" / "tiny-llama-lora.yaml").read_text())
VERTEX = {"launcher": "vertex", "image": "trainer:1", "machine_type": "n2-standard-8"}

# (a family's prefix or exact name, words of its rule)
PREFIXES = [
    ("PYTHON", "changes the Python interpreter"),
    ("LD_", "changes the dynamic loader"),
    ("DYLD_", "changes the dynamic loader"),
    ("GOOGLE_", "credentials, project or service endpoint"),
    ("CLOUDSDK_", "credentials, project or service endpoint"),
    ("GCE_METADATA_", "credentials, project or service endpoint"),
    ("AWS_", "credentials, project or service endpoint"),
    ("LORAFLOW_", "loraflow's"),
    ("AIRFLOW", "loraflow's, Airflow's"),
    ("LC_", "process basic"),
]
SUFFIXES = [
    ("_PROXY", "proxy"),
    ("_EMULATOR_HOST", "credentials, project or service endpoint"),
    ("_CA_BUNDLE", "TLS certificates"),
]
WORD = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_", max_size=20)


@st.composite
def any_case(draw: st.DrawFn, name: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    return "".join(c.lower() if flip else c for c, flip in zip(name, flips, strict=True))


def assert_refused_by_first_matching_rule(name: str, family_rule: str) -> None:
    """``name`` is refused, naming it and the first rule that matches it; its family's rule is among
    those that match (a name can belong to two families, e.g. GIT_X_PROXY: the first one listed wins)."""
    matching = [r.reason for r in env_rules.RULES if r.matches(name.upper())]
    reason = env_rules.refusal(name)
    assert reason is not None and name in reason and matching and matching[0] in reason
    assert any(family_rule in m for m in matching)


@given(st.sampled_from(PREFIXES), WORD, st.data())
def test_a_name_of_a_refused_prefix_family_is_refused_in_any_case_with_its_rule(
    family: tuple[str, str], rest: str, data: st.DataObject
) -> None:
    prefix, rule = family
    name = data.draw(any_case(prefix + rest))
    if name in env_rules.STEP_TUNABLES:
        return
    assert_refused_by_first_matching_rule(name, rule)


@given(WORD, st.sampled_from(SUFFIXES), st.data())
def test_a_name_of_a_refused_suffix_family_is_refused_in_any_case_with_its_rule(
    rest: str, family: tuple[str, str], data: st.DataObject
) -> None:
    suffix, rule = family
    name = data.draw(any_case(rest + suffix))
    assert_refused_by_first_matching_rule(name, rule)


@given(st.text(max_size=30))
def test_only_portable_upper_case_names_can_pass(name: str) -> None:
    if env_rules.refusal(name) is None:
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]{0,127}", name)


@pytest.mark.parametrize(
    "name", ["XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_PLATFORMS", "JAX_TRACEBACK_FILTERING", "TF_CPP_MIN_LOG_LEVEL",
             "HF_TOKEN", "VLLM_LOGGING_LEVEL", "NCCL_DEBUG", "LORAFLOW_LOG_LEVEL", "MY_FLAG", "_X"],
)  # fmt: skip
def test_tuning_a_step_is_allowed(name: str) -> None:
    assert env_rules.refusal(name) is None


def test_every_variable_the_launchers_set_themselves_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the local launcher passes through from the worker or forces, and what the Vertex and GKE
    containers get from loraflow, is the deployer's or loraflow's: a spec cannot override any of it
    (but the tunables a spec may set, which the launchers merely default)."""
    candidates = ["PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT",
                  "GOOGLE_APPLICATION_CREDENTIALS", "LORAFLOW_SCRATCH", "LORAFLOW_ENVS_DIR", "LORAFLOW_FAULT",
                  "LORAFLOW_FAULT_STATE", "JAX_PLATFORMS", "XLA_FLAGS", "LORAFLOW_LOG_LEVEL"]  # fmt: skip
    for name in candidates:
        monkeypatch.setenv(name, os.environ.get(name, "x"))
    tunables = {"JAX_PLATFORMS", "XLA_FLAGS", "VLLM_LOGGING_LEVEL", *env_rules.STEP_TUNABLES}
    compute = compute_from(**VERTEX, hosts=2)
    names = set(launch.step_environment({})) | {e["name"] for e in vertex.container_env(compute)}
    names |= {e["name"] for e in gke.container_env(compute, "lf-x")}
    assert {"PATH", "PYTHONPATH", "HF_HUB_OFFLINE", "LORAFLOW_EXPECTED_HOSTS", "LORAFLOW_COORDINATOR_HOST"} <= names
    assert {n for n in names - tunables if env_rules.refusal(n) is None} == set()


def with_env(name: str, where: str = "lora_sft") -> dict:
    data = copy.deepcopy(TINY)
    data.setdefault("compute", {})[where] = {**VERTEX, "env": {name: "1"}}
    return data


@given(st.text(max_size=24))
def test_the_spec_refuses_exactly_what_the_rules_refuse_naming_key_and_rule(name: str) -> None:
    reason = env_rules.refusal(name)
    if reason is None:
        assert validate_spec(with_env(name), "t").compute["lora_sft"].env == {name: "1"}
        return
    with pytest.raises(SpecError) as err:
        validate_spec(with_env(name), "t")
    assert any(path.startswith("compute.lora_sft.env") and msg == reason for path, msg in err.value.problems)


@given(st.sampled_from(["LD_PRELOAD", "PYTHONPATH", "https_proxy", "GOOGLE_APPLICATION_CREDENTIALS", "PATH"]))
def test_secrets_obey_the_same_rules(name: str) -> None:
    data = copy.deepcopy(TINY)
    data["secrets"] = {name: {"connection": "hf"}}
    with pytest.raises(SpecError) as err:
        validate_spec(data, "t")
    assert (f"secrets.{name}", env_rules.refusal(name)) in err.value.problems
