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
def test_the_rules_refuse_no_harmless_name(name: str) -> None:
    """The rules name what takes a step over; a step's environment asks the allow-list as well."""
    assert env_rules.refusal(name) is None


def test_every_variable_the_launchers_set_themselves_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the local launcher passes through from the worker or forces, and what the Vertex and GKE
    containers get from loraflow, is the deployer's or loraflow's: a spec cannot override any of it
    (but the tunables a spec may set, which the launchers merely default)."""
    candidates = ["PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT",
                  "GOOGLE_APPLICATION_CREDENTIALS", "LORAFLOW_SCRATCH", "LORAFLOW_ENVS_DIR", "LORAFLOW_FAULT",
                  "LORAFLOW_FAULT_STATE", "JAX_PLATFORMS", "XLA_FLAGS", "LORAFLOW_LOG_LEVEL", "JAX_COMPILATION_CACHE_DIR",
                  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]  # fmt: skip
    for name in candidates:
        monkeypatch.setenv(name, os.environ.get(name, "x"))
    compute = compute_from(**VERTEX, hosts=2)
    names = set(launch.step_environment({})) | {e["name"] for e in vertex.container_env(compute)}
    names |= {e["name"] for e in gke.container_env(compute, "lf-x")}
    assert {"PATH", "PYTHONPATH", "HF_HUB_OFFLINE", "LORAFLOW_EXPECTED_HOSTS", "LORAFLOW_COORDINATOR_HOST"} <= names
    assert {"VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"} <= names
    tunables = {"JAX_PLATFORMS", "XLA_FLAGS", "VLLM_LOGGING_LEVEL", "LORAFLOW_LOG_LEVEL"}
    assert {n for n in names if env_rules.step_refusal(n) is None} == tunables


def with_env(name: str, where: str = "lora_sft", value: str = "1") -> dict:
    data = copy.deepcopy(TINY)
    data.setdefault("compute", {})[where] = {**VERTEX, "env": {name: value}}
    return data


@given(st.one_of(st.text(max_size=24), st.sampled_from(sorted(env_rules.ALLOWED))))
def test_the_spec_refuses_exactly_what_the_rules_refuse_naming_key_and_rule(name: str) -> None:
    reason = env_rules.step_refusal(name)
    if reason is None:
        assert name in env_rules.ALLOWED
        value = GOOD[name]
        assert validate_spec(with_env(name, value=value), "t").compute["lora_sft"].env == {name: value}
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


# ------------------------------------------------------------------ the allow-list (issue 29, item 4)


def test_every_launcher_turns_usage_statistics_off_whatever_the_step_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM reports usage to its makers unless told not to; every step environment tells it (and every
    library that honours DO_NOT_TRACK), set last, so neither the worker's environment, a spec's
    compute.env nor a secret can turn it back on."""
    monkeypatch.setenv("DO_NOT_TRACK", "0")
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")
    again = {"VLLM_NO_USAGE_STATS": "0", "DO_NOT_TRACK": "0", "HF_HUB_DISABLE_TELEMETRY": "0"}
    compute = compute_from(**VERTEX, hosts=2)
    envs = {
        "local": launch.step_environment(again),
        "vertex": {e["name"]: e["value"] for e in vertex.container_env(compute, again)},
        "gke": {e["name"]: e["value"] for e in gke.container_env(compute_from(**{**VERTEX, "launcher": "gke"}), "lf-x", again)},
    }  # fmt: skip
    for where, env in envs.items():
        off = {k: env.get(k) for k in again}
        assert off == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}, where


# One value each allowed variable takes, and one it does not (a path: the shape of every way out).
GOOD = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_tpu_enable_latency_hiding_scheduler=true",
    "LIBTPU_INIT_ARGS": "--xla_tpu_scoped_vmem_limit_kib=98304 --xla_enable_async_all_gather=true",
    "JAX_PLATFORMS": "tpu,cpu", "JAX_TRACEBACK_FILTERING": "off", "JAX_DEBUG_NANS": "true", "JAX_LOG_COMPILES": "1",
    "JAX_DEFAULT_MATMUL_PRECISION": "highest", "TF_CPP_MIN_LOG_LEVEL": "0", "TPU_STDERR_LOG_LEVEL": "2",
    "TPU_MIN_LOG_LEVEL": "1", "VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
    "OMP_NUM_THREADS": "8", "TOKENIZERS_PARALLELISM": "false", "LORAFLOW_LOG_LEVEL": "info",
    "LORAFLOW_JOIN_TIMEOUT": "600", "LORAFLOW_HEARTBEAT_TIMEOUT": "120", "LORAFLOW_SHUTDOWN_TIMEOUT": "7200",
    "LORAFLOW_HARDWARE": "tpu",
}  # fmt: skip


def test_every_allowed_variable_says_why_and_takes_its_values_only() -> None:
    assert set(GOOD) == set(env_rules.ALLOWED)  # a new entry comes with a value it takes
    assert env_rules.STEP_TUNABLES <= set(env_rules.ALLOWED)
    for name, allowed in env_rules.ALLOWED.items():
        assert allowed.reason and "\n" not in allowed.reason and allowed.values, name
        assert env_rules.refusal(name) is None, name  # no entry contradicts the rules
        assert env_rules.value_problem(name, GOOD[name]) is None, name
        for bad in ("/tmp/x", "gs://evil/x", "http://evil.example", "~/x", "", "1 2"):
            assert env_rules.value_problem(name, bad) is not None or name in {"XLA_FLAGS", "LIBTPU_INIT_ARGS"}, (
                name,
                bad,
            )


@given(st.sampled_from(["XLA_FLAGS", "LIBTPU_INIT_ARGS"]), st.lists(st.text(max_size=40), max_size=4))
def test_xla_flags_pass_only_when_each_is_on_the_flag_allow_list_with_a_plain_value(name: str, words: list) -> None:
    value = " ".join(words)
    if env_rules.value_problem(name, value) is not None:
        return
    for word in value.split():
        flag, _, flag_value = word.removeprefix("--").partition("=")
        assert word.startswith("--") and flag in env_rules.XLA_FLAGS_ALLOWED
        assert re.fullmatch(r"[A-Za-z0-9_.+-]*", flag_value) and "dump" not in flag


OFF_THE_FLAG_LIST = "is not on the allow-list of XLA flags a spec may set"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ("--xla_dump_to=/tmp/x", "--xla_dump_to " + OFF_THE_FLAG_LIST),
        ("--xla_dump_hlo_as_text", "--xla_dump_hlo_as_text " + OFF_THE_FLAG_LIST),
        ("--xla_force_host_platform_device_count=8 --xla_dump_to=gs://evil/x", "--xla_dump_to " + OFF_THE_FLAG_LIST),
        ("--xla_gpu_cuda_data_dir=/tmp/x", "--xla_gpu_cuda_data_dir " + OFF_THE_FLAG_LIST),
        ("--XLA_DUMP_TO=/x", "'--XLA_DUMP_TO=/x' is not a flag"),
        ("xla_dump_to=/x", "'xla_dump_to=/x' is not a flag"),
        ("--xla_force_host_platform_device_count=/tmp/x", "the value of --xla_force_host_platform_device_count, "
                                                          "'/tmp/x', is not a plain word or number"),
        # the value and the flag are checked whole, never by their start
        ("--xla_force_host_platform_device_count=8/tmp/x", "the value of --xla_force_host_platform_device_count, "
                                                           "'8/tmp/x', is not a plain word or number"),
        ("--xla_force_host_platform_device_count=8 /tmp/x", "'/tmp/x' is not a flag"),
        ("--xla_force_host_platform_device_count_dump=/x", "--xla_force_host_platform_device_count_dump "
                                                           + OFF_THE_FLAG_LIST),
        ("--xla_force_host_platform_device_count8/tmp/x", "'--xla_force_host_platform_device_count8/tmp/x' is not a flag"),
    ],
)  # fmt: skip
def test_a_flag_that_writes_or_names_a_path_is_refused_naming_it(flags: str, says: str) -> None:
    for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
        with pytest.raises(SpecError) as err:
            validate_spec(with_env(name, value=flags), "t")
        [(where, message)] = err.value.problems
        assert where == "compute.lora_sft.env" and message.startswith(f"{name}: {says}"), message
        if OFF_THE_FLAG_LIST in says:
            assert "docs/security.md, 'Asking for a variable, flag or override'" in message


@pytest.mark.parametrize(
    "name", ["JAX_DUMP_IR_TO", "VLLM_USAGE_STATS_SERVER", "VLLM_CONFIG_ROOT", "VLLM_LOGGING_CONFIG_PATH",
             "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME", "GRPC_TRACE", "VLLM_NO_USAGE_STATS",
             "DO_NOT_TRACK", "HF_HUB_DISABLE_TELEMETRY", "TPU_LOG_DIR", "NCCL_DEBUG_FILE", "MY_FLAG", "HF_TOKEN"],
)  # fmt: skip
def test_a_name_off_the_allow_list_is_refused_naming_it_the_list_and_how_to_ask(name: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_spec(with_env(name, value="x"), "t")
    [(where, says)] = err.value.problems
    assert where == f"compute.lora_sft.env.{name}"
    assert says.startswith(f"{name} is not on the allow-list of variables a spec may set for a step")
    assert f"ALLOWED: {', '.join(sorted(env_rules.ALLOWED))}); remove it; to ask for one" in says
    assert "docs/security.md, 'Asking for a variable, flag or override'" in says


@pytest.mark.parametrize(
    ("name", "lowest", "highest", "unit"),
    [("OMP_NUM_THREADS", 1, 1024, "a number"), ("LORAFLOW_JOIN_TIMEOUT", 1, 86400, "whole seconds"),
     ("LORAFLOW_HEARTBEAT_TIMEOUT", 1, 86400, "whole seconds"),
     ("LORAFLOW_SHUTDOWN_TIMEOUT", 1, 86400, "whole seconds")],
)  # fmt: skip
def test_a_whole_number_variable_takes_its_documented_range_compared_as_a_number(
    name: str, lowest: int, highest: int, unit: str
) -> None:
    """OMP_NUM_THREADS took up to 9999 and the timeouts 99999 (a digit count, not the bound they name)."""
    for good in (lowest, highest, (lowest + highest) // 2):
        assert validate_spec(with_env(name, value=str(good)), "t").compute["lora_sft"].env == {name: str(good)}
    for bad in (lowest - 1, highest + 1, 9999, 99999, 10**30, "01", "+8", "8.0", "1e3", "-1", " 8", "8 "):
        if isinstance(bad, int) and lowest <= bad <= highest:
            continue
        with pytest.raises(SpecError) as err:
            validate_spec(with_env(name, value=str(bad)), "t")
        [(where, says)] = err.value.problems
        assert where == "compute.lora_sft.env"
        assert says == f"{name}: the value {str(bad)!r} is not {unit} from {lowest} to {highest}; write one of those"


def test_a_whole_number_entry_takes_its_words_and_its_check_from_one_range() -> None:
    entry = env_rules.whole_number("why it is there", 2, 90, "whole seconds")
    assert (entry.reason, entry.values, entry.bounds) == ("why it is there", "whole seconds from 2 to 90", (2, 90))
    assert [v for v in ("1", "2", "45", "90", "91", "02", "0", "x", "") if entry.takes(v)] == ["2", "45", "90"]
    assert env_rules.whole_number("r", 0, 3).values == "a number from 0 to 3"
    assert env_rules.whole_number("r", 0, 3).takes("0")


def test_a_name_is_portable_up_to_128_characters() -> None:
    assert env_rules.refusal("A" * 128) is None
    assert "is not a portable environment variable name" in (env_rules.refusal("A" * 129) or "")


@pytest.mark.parametrize("suffix", env_rules.SECRET_SUFFIXES)
def test_a_secret_goes_only_into_a_variable_named_for_one(suffix: str) -> None:
    assert env_rules.check_secret_name(f"HF{suffix}") == f"HF{suffix}"
    with pytest.raises(ValueError) as err:
        env_rules.check_secret_name(f"HF{suffix}_FILE")
    assert str(err.value) == (
        f"HF{suffix}_FILE is not named for a secret: a library may read it as a setting, split the value and print "
        "a piece of it, which the log masker cannot recognise; map the secret to the variable the step "
        "reads it from, named ending in _TOKEN, _KEY, _SECRET or _PASSWORD (e.g. HF_TOKEN)"
    )


def test_every_refused_value_of_a_step_environment_is_named_at_once() -> None:
    with pytest.raises(ValueError) as err:
        env_rules.check_step_env({"OMP_NUM_THREADS": "0", "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "9"})
    assert str(err.value) == (
        "OMP_NUM_THREADS: the value '0' is not a number from 1 to 1024; write one of those; "
        "TF_CPP_MIN_LOG_LEVEL: the value '9' is not 0, 1, 2 or 3; write one of those"
    )
    with pytest.raises(ValueError) as err:
        env_rules.check_value("a\0b")
    assert str(err.value) == "the value contains a NUL character, which no environment can hold; remove it"
