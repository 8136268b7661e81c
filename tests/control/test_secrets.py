"""Secrets named in a spec: resolved from connections, passed to the step only by environment, and
replaced by *** wherever the runner passes text on."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loraflow.errors import LoraflowError, SpecError, StepError
from loraflow.launchers import credentials
from loraflow.launchers.local import LocalLauncher, StepRefused
from loraflow.spec.schema import load_spec, validate_spec

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_PlantedTokenValue0123456789"


def spec_with(secrets: dict) -> object:
    data = load_spec(REPO / "pipelines" / "tiny-llama-lora.yaml").model_dump(mode="json")
    data["secrets"] = secrets
    return validate_spec(data, "test spec")


def test_a_spec_names_connections_and_a_stage_gets_only_its_secrets() -> None:
    spec = spec_with(
        {
            "HF_TOKEN": {"connection": "huggingface_default"},
            "GCP_KEY": {"connection": "gcp_sa", "field": "extra.keyfile_dict", "stages": ["publish"]},
        }
    )
    assert set(credentials.wanted(spec, "lora_sft")) == {"HF_TOKEN"}
    assert set(credentials.wanted(spec, "publish")) == {"HF_TOKEN", "GCP_KEY"}
    key = {"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----\nMIIEabcdefgh\n-----END"}
    conns = {
        "huggingface_default": SimpleNamespace(password=TOKEN, extra_dejson={}),
        "gcp_sa": SimpleNamespace(password=None, extra_dejson={"keyfile_dict": key}),
    }
    got = credentials.resolve(spec, "publish", conns.__getitem__)
    assert got == {"HF_TOKEN": TOKEN, "GCP_KEY": json.dumps(key)}


@pytest.mark.parametrize(
    "secrets, message",
    [
        ({"hf_token": {"connection": "hf"}}, "hf_token"),
        ({"PATH": {"connection": "hf"}}, "PATH"),
        ({"LORAFLOW_X": {"connection": "hf"}}, "LORAFLOW_X"),
        ({"HF_TOKEN": {"connection": "has space"}}, "not a connection id"),
        ({"HF_TOKEN": {"connection": "hf", "field": "schema"}}, "password, login, host or extra.KEY"),
        ({"HF_TOKEN": {"connection": "hf", "stages": ["train"]}}, "unknown stage"),
        ({"HF_TOKEN": {"connection": "hf", "value": TOKEN}}, "unknown key"),
    ],
)
def test_bad_secret_entries_are_refused_with_the_fix(secrets: dict, message: str) -> None:
    with pytest.raises(SpecError, match="secrets") as err:
        spec_with(secrets)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "name", ["JAX_PLATFORMS", "XLA_FLAGS", "LIBTPU_INIT_ARGS", "VLLM_PLUGINS", "HF_HUB_CACHE", "MY_VAR"]
)
def test_a_secret_goes_only_into_a_variable_named_for_a_secret(name: str) -> None:
    """Issue 29, item 9: a token mapped to JAX_PLATFORMS reached the logs in pieces (JAX splits the
    value at its commas and prints a piece, which no masker knows). A library parses a setting; only a
    variable named for a secret is read whole as one."""
    with pytest.raises(SpecError) as err:
        spec_with({name: {"connection": "hf"}})
    ((path, message),) = err.value.problems
    assert path == f"secrets.{name}"
    assert f"{name} is not named for a secret" in message and "_TOKEN, _KEY, _SECRET or _PASSWORD" in message
    assert "e.g. HF_TOKEN" in message


@pytest.mark.parametrize(
    "name", ["HF_TOKEN", "GCP_KEY", "WANDB_API_KEY", "DB_PASSWORD", "CLIENT_SECRET", "VLLM_API_KEY"]
)
def test_names_made_for_secrets_are_taken(name: str) -> None:
    assert set(spec_with({name: {"connection": "hf"}}).secrets) == {name}


def test_a_missing_connection_or_field_is_named_without_any_value() -> None:
    spec = spec_with({"HF_TOKEN": {"connection": "hf"}, "OTHER_TOKEN": {"connection": "other", "field": "login"}})

    def lookup(conn_id: str) -> object:
        if conn_id == "hf":
            return SimpleNamespace(password=TOKEN, login=None)
        raise KeyError(conn_id)

    with pytest.raises(LoraflowError, match=r"HF_TOKEN: Airflow connection 'hf' has no login|'other' could not"):
        credentials.resolve(spec, "gate", lookup)
    with pytest.raises(LoraflowError) as err:
        credentials.resolve(spec_with({"HF_TOKEN": {"connection": "hf", "field": "login"}}), "gate", lookup)
    assert "'hf' has no login" in str(err.value) and TOKEN not in str(err.value)


def test_the_step_gets_the_secret_in_its_environment_and_no_output_carries_it(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "print('argv', sys.argv[1:], flush=True)\n"
        "print('token is', os.environ['HF_TOKEN'], flush=True)\n"
        "print('ERROR: rejected token', os.environ['HF_TOKEN'], file=sys.stderr, flush=True)\n"
        "sys.exit(2)\n"
    )
    lines: list[str] = []
    with pytest.raises(StepRefused) as err:
        LocalLauncher().run([sys.executable, "-c", code, "--output", "gs://b/p"], lines.append, {}, {"HF_TOKEN": TOKEN})
    assert "token is ***" in lines and TOKEN not in "\n".join(lines)
    assert "rejected token ***" in str(err.value) and TOKEN not in str(err.value)
    assert isinstance(err.value, StepError)


def test_a_crash_is_a_plain_step_error() -> None:
    with pytest.raises(StepError) as err:
        LocalLauncher().run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], print)
    assert not isinstance(err.value, StepRefused) and "killed by signal 9" in str(err.value)


def test_a_multiline_key_is_redacted_line_by_line() -> None:
    key = json.dumps({"private_key": "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END"})
    redact = credentials.Redactor({"KEY": key})
    assert redact("oops MIIEvQIBADANBgkqhkiG9w0BAQEFAASC leaked") == "oops *** leaked"
    assert TOKEN not in credentials.fingerprint(TOKEN) and credentials.fingerprint(TOKEN).startswith("sha256:")
