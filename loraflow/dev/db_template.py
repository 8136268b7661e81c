"""One ``airflow db migrate`` for a test session's SQLite stacks instead of one per stack.

A local stack (``loraflow.dev.demo.LocalAirflow``) on a new SQLite database migrates it before its
components start: 8 CPU seconds on 2 cores, most of them Airflow importing itself, the same for a database
already at head. With ``$LORAFLOW_AIRFLOW_DB_TEMPLATE`` naming a folder (the end-to-end tier sets one per
pytest session, tests/e2e/conftest.py), the first such stack migrates a database there once and every
stack copies it and the airflow.cfg that migrate wrote, as migrate in its own home would have left them:
the template's paths made the stack's, and the secrets Airflow puts in a config it writes made anew. A
stack whose home already has a database (a second ``make ui`` on the same home) still migrates it.
"""

from __future__ import annotations

import base64
import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraflow.errors import LoraflowError

DB_TEMPLATE_ENV = "LORAFLOW_AIRFLOW_DB_TEMPLATE"
DATABASE = "airflow.db"
CONFIG = "airflow.cfg"
_MIGRATED = "migrated"  # written last: a template folder without it is a migrate that did not finish


def _urlsafe_key() -> str:  # what Airflow writes as [core] fernet_key (cryptography's Fernet.generate_key)
    return base64.urlsafe_b64encode(os.urandom(32)).decode()


def _key16() -> str:  # what Airflow writes as [api] secret_key and [api_auth] jwt_secret
    return base64.b64encode(os.urandom(16)).decode()


# The options Airflow fills with a random value when it writes a new airflow.cfg, each written once.
CONFIG_SECRETS: dict[str, Callable[[], str]] = {
    "fernet_key": _urlsafe_key,
    "secret_key": _key16,
    "jwt_secret": _key16,
}


def sqlite_url(home: Path) -> str:
    """The metadata database a local stack in ``home`` uses unless it is given another."""
    return f"sqlite:///{home / DATABASE}"


@dataclass(frozen=True)
class DbTemplate:
    """A migrated SQLite metadata database and the airflow.cfg its migrate wrote, both in ``home``."""

    home: Path

    def copy_to(self, home: Path) -> None:
        """airflow.db and airflow.cfg in ``home`` as ``airflow db migrate`` there would have left them (an
        airflow.cfg already there is kept, as Airflow keeps it)."""
        home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.home / DATABASE, home / DATABASE)
        if not (home / CONFIG).exists():
            self._write_config(home)

    def _write_config(self, home: Path) -> None:
        text = (self.home / CONFIG).read_text().replace(str(self.home), str(home))
        for option, make in CONFIG_SECRETS.items():
            text, found = re.subn(rf"(?m)^{option} = .*$", f"{option} = {make()}", text)  # base64: no escapes
            if found != 1:
                raise LoraflowError(
                    f"{self.home / CONFIG} has {found} {option} options, not one: make the template anew"
                )
        config = home / CONFIG
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # as Airflow keeps it: this user's only
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)


def db_template(folder: Path, airflow: Path | None = None) -> DbTemplate:
    """The template in ``folder``, migrated by ``airflow`` (the one beside this Python) if it is not
    there yet; one process at a time makes it."""
    folder.mkdir(parents=True, exist_ok=True)
    home = folder / "home"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / _MIGRATED).exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir()
            env = {
                **os.environ,
                "AIRFLOW_HOME": str(home),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlite_url(home),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            }
            command = [str(airflow or Path(sys.executable).with_name("airflow")), "db", "migrate"]
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
            (home / _MIGRATED).touch()
    return DbTemplate(home)
