"""A test session's local stacks copy one migrated SQLite database instead of each running ``airflow db
migrate`` (loraflow/dev/db_template.py). A stand-in ``airflow`` writes what migrate writes (a config naming
its home, with generated secrets, and a database) and counts its calls; the real migrate is what every
end-to-end stack runs (tests/e2e)."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.dev import db_template
from loraflow.dev.db_template import DB_TEMPLATE_ENV, DbTemplate
from loraflow.dev.demo import LocalAirflow
from loraflow.errors import LoraflowError

FAKE_MIGRATE = """#!/bin/sh
[ "$1 $2" = "db migrate" ] || exit 2
echo migrate "$AIRFLOW_HOME" >> "{calls}"
echo "$AIRFLOW__DATABASE__SQL_ALCHEMY_CONN $AIRFLOW__CORE__LOAD_EXAMPLES" >> "{calls}.env"
[ -e "$AIRFLOW_HOME/../fail" ] && exit 3
cat > "$AIRFLOW_HOME/airflow.cfg" <<CFG
[core]
dags_folder = $AIRFLOW_HOME/dags
fernet_key = generated-fernet
[database]
sql_alchemy_conn = sqlite:///$AIRFLOW_HOME/airflow.db
[api]
secret_key = generated-secret
[api_auth]
jwt_secret = generated-jwt
[logging]
base_log_folder = $AIRFLOW_HOME/logs
CFG
echo "tables of $AIRFLOW_HOME" > "$AIRFLOW_HOME/airflow.db"
"""


@pytest.fixture
def airflow(tmp_path: Path) -> Path:
    script = tmp_path / "bin" / "airflow"
    script.parent.mkdir()
    script.write_text(FAKE_MIGRATE.format(calls=tmp_path / "calls"))
    script.chmod(0o755)
    return script


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def options(config: Path) -> dict[str, str]:
    return dict(line.split(" = ", 1) for line in config.read_text().splitlines() if " = " in line)


def test_a_copy_is_what_migrate_in_its_own_home_writes_with_secrets_of_its_own(tmp_path: Path, airflow: Path) -> None:
    template = db_template.db_template(tmp_path / "session" / "template", airflow)  # its parent made too
    first, second = tmp_path / "stack-1" / "airflow", tmp_path / "stack-2" / "airflow"
    template.copy_to(first)
    template.copy_to(second)
    made = options(template.home / "airflow.cfg")
    copied = options(first / "airflow.cfg")
    assert copied["dags_folder"] == f"{first}/dags"
    assert copied["sql_alchemy_conn"] == f"sqlite:///{first}/airflow.db"
    assert copied["base_log_folder"] == f"{first}/logs"
    assert str(template.home) not in (first / "airflow.cfg").read_text()
    for secret in ("fernet_key", "secret_key", "jwt_secret"):
        assert copied[secret] not in (made[secret], options(second / "airflow.cfg")[secret]), secret
    assert len(base64.urlsafe_b64decode(copied["fernet_key"])) == 32  # as Fernet.generate_key() makes one
    assert len(base64.b64decode(copied["secret_key"])) == len(base64.b64decode(copied["jwt_secret"])) == 16
    assert stat.S_IMODE((first / "airflow.cfg").stat().st_mode) == 0o600  # it holds the keys
    assert (first / "airflow.db").read_bytes() == (template.home / "airflow.db").read_bytes()
    assert calls(tmp_path) == [f"migrate {template.home}"]


def test_the_template_is_migrated_once_and_again_after_a_migrate_that_did_not_finish(
    tmp_path: Path, airflow: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://someone-elses/airflow")
    monkeypatch.setattr(sys, "executable", str(airflow.with_name("python")))  # the airflow beside this Python
    folder = tmp_path / "template"
    db_template.db_template(folder)
    db_template.db_template(folder)
    assert len(calls(tmp_path)) == 1
    # its own SQLite database, never the one the environment names; no example DAGs
    assert (tmp_path / "calls.env").read_text() == f"sqlite:///{folder / 'home' / 'airflow.db'} False\n"
    (folder / "home" / "migrated").unlink()  # as a migrate killed half-way leaves it
    db_template.db_template(folder)
    assert len(calls(tmp_path)) == 2


def test_a_migrate_that_failed_stops_the_stack_and_leaves_no_template(tmp_path: Path, airflow: Path) -> None:
    folder = tmp_path / "template"
    folder.mkdir()
    (folder / "fail").touch()
    with pytest.raises(subprocess.CalledProcessError):
        db_template.db_template(folder, airflow)
    (folder / "fail").unlink()
    db_template.db_template(folder, airflow)
    assert len(calls(tmp_path)) == 2  # made again, not taken from the failed try


def test_a_config_airflow_wrote_differently_is_refused_not_copied_with_the_templates_keys(tmp_path: Path) -> None:
    home = tmp_path / "template"
    home.mkdir()
    (home / "airflow.cfg").write_text("[core]\nfernet_key = old\n[api]\nsecret_key = old\n")  # no jwt_secret
    (home / "airflow.db").write_text("tables")
    with pytest.raises(LoraflowError, match="0 jwt_secret options"):
        DbTemplate(home).copy_to(tmp_path / "stack")


def test_a_stack_copies_the_template_only_for_a_new_sqlite_database(
    tmp_path: Path, airflow: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DB_TEMPLATE_ENV, str(tmp_path / "template"))

    def stack(name: str, **kwargs: str) -> LocalAirflow:
        local = LocalAirflow(tmp_path / name / "airflow", {}, **kwargs)  # type: ignore[arg-type]
        local.airflow = str(airflow)
        local._migrate()
        return local

    new = stack("new")
    template_home = tmp_path / "template" / "home"
    assert calls(tmp_path) == [f"migrate {template_home}"]  # the template's migrate, none of its own
    assert (new.home / "airflow.db").read_text() == f"tables of {template_home}\n"
    stack("another")
    assert len(calls(tmp_path)) == 1

    again = stack("new")  # a second `make ui` on the same home: its database is migrated in place
    assert calls(tmp_path)[-1] == f"migrate {again.home}"
    stack("postgres", database_url="postgresql+psycopg2://airflow@127.0.0.1:1/airflow")
    assert calls(tmp_path)[-1] == f"migrate {tmp_path / 'postgres' / 'airflow'}"
    monkeypatch.delenv(DB_TEMPLATE_ENV)
    stack("untemplated")
    assert calls(tmp_path)[-1] == f"migrate {tmp_path / 'untemplated' / 'airflow'}"
    assert os.environ.get(DB_TEMPLATE_ENV) is None
