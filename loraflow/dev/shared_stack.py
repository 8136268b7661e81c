"""One local stack (``loraflow.dev.demo.local_stack``: the GCS emulator and Airflow) shared by several
end-to-end test modules, one module after another, instead of one stack each.

A stack's start costs about 53 CPU seconds on 2 cores and its stop a few more (docs/architecture.md):
modules whose runs cannot disturb each other share one. Each module brings its own pipeline specs,
and the stack refuses a spec whose DAG name or artifact root another module's spec has: distinct DAG
names keep the runs, registries and Asset events apart, and an artifact root of its own keeps a module
from taking another's stages from the cache (the stage cache is per root: ``_cache/`` beside the runs).
A module may name one whose root (and cached stages) it shares on purpose (``use``'s ``cache_from``): it
runs after that module (``together``'s ``after``), whose runs it then cannot disturb.

The stack starts when the first module asks for it, with that module's specs in place; a later module's
specs are parsed at once (a priority parsing request for each DAG file, as the UI's reparse button
makes), not at the DAG processor's next pass. Whoever owns the stack closes it (tests/e2e/conftest.py:
after the last module that uses it). A stack runs the LocalExecutor on SQLite, or Celery workers on a
database it starts with itself (tests/e2e/conftest.py has one of each).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

from loraflow.dev.demo import LocalAirflow, local_stack
from loraflow.dev.local_celery import CeleryWorkers
from loraflow.errors import LoraflowError
from loraflow.spec.schema import load_spec
from loraflow.storage import gcs

# What local_stack points this process's GCS client at (the emulator's address and project).
EMULATOR_ENV = ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT")


def together(modules: Sequence[str], sharing: Collection[str], after: Mapping[str, str] | None = None) -> list[int]:
    """An order for tests given as their modules, in collection order (indices into ``modules``): the tests
    of the ``sharing`` modules one module after another, where the first of them came, so that a stack
    they share is up only while they run; every other test keeps its place, each module its own order.
    A sharing module that ``after`` maps to another sharing module runs right after that one."""
    grouped = [i for i, m in enumerate(modules) if m in sharing]
    first_seen = list(dict.fromkeys(modules[i] for i in grouped))
    for late, early in (after or {}).items():
        if late in first_seen and early in first_seen:
            first_seen.remove(late)
            first_seen.insert(first_seen.index(early) + 1, late)
    order: list[int] = []
    for i, module in enumerate(modules):
        if module not in sharing:
            order.append(i)
        elif i == grouped[0]:
            order.extend(sorted(grouped, key=lambda j: (first_seen.index(modules[j]), j)))
    return order


class SharedStack:
    """A stack on ``home`` (its specs in ``home/pipelines``), started with ``env`` added to the environment
    its processes take (e.g. OpenLineage's transport), by the first ``use``: on SQLite with the LocalExecutor,
    or with ``celery``'s workers on the database ``database()`` starts as the stack does (a context manager
    yielding its SQLAlchemy URL, e.g. ``loraflow.dev.local_postgres.running``), stopped after the stack."""

    def __init__(
        self,
        home: Path,
        env: Mapping[str, str] | None = None,
        *,
        database: Callable[[], AbstractContextManager[str]] | None = None,
        celery: CeleryWorkers | None = None,
    ) -> None:
        self.home = home
        self.pipelines = home / "pipelines"
        self.env = dict(env or {})
        self.database = database
        self.celery = celery
        self.airflow: LocalAirflow | None = None
        self.starts = 0  # how many times a stack was started on home (1 while shared as meant)
        self.owners: dict[str, str] = {}  # artifact root -> the module whose specs have it
        self._emulator_env: dict[str, str] = {}
        self._exit = ExitStack()

    def use(self, module: str, *specs: Path, cache_from: str = "") -> LocalAirflow:
        """The stack, with ``module``'s pipeline ``specs`` added (their DAGs parsed), and this process's
        GCS client pointed at its emulator (another stack or emulator started since may have moved it).
        ``cache_from``: a module that ran before whose artifact root the specs may share, to take its
        runs' cached stages."""
        for path in specs:
            self._claim(module, path, cache_from)
        self.pipelines.mkdir(parents=True, exist_ok=True)
        for path in specs:
            shutil.copy(path, self.pipelines / path.name)
        if self.airflow is None:
            self._start()
        elif specs:
            self.reparse()
        os.environ.update(self._emulator_env)
        gcs.client.cache_clear()
        assert self.airflow is not None
        return self.airflow

    def _claim(self, module: str, path: Path, cache_from: str = "") -> None:
        """Note ``module`` as the owner of the spec's artifact root; refuse a root another module owns (but
        ``cache_from``), or a file name already in the stack (a spec's file is named after its DAG, so no two
        DAGs share a name)."""
        spec = load_spec(path)
        if (self.pipelines / path.name).exists():
            raise LoraflowError(
                f"{path.name} is in the shared stack already: give {module}'s copy a DAG name of its own"
            )
        root = spec.artifact_root  # the spec's schema drops a trailing slash
        owner = self.owners.setdefault(root, module)
        if owner not in (module, cache_from):
            raise LoraflowError(
                f"{module}'s {path.name} has the artifact root {root}, which {owner}'s specs have in the "
                "shared stack: give it one of its own"
            )

    def _start(self) -> None:
        database_url = self._exit.enter_context(self.database()) if self.database is not None else None
        self.airflow = self._exit.enter_context(
            local_stack(
                home=self.home,
                in_memory=True,
                pipelines_dir=self.pipelines,
                database_url=database_url,
                celery=self.celery,
                env=self.env,
            )
        )
        self.starts += 1
        self._emulator_env = {k: os.environ[k] for k in EMULATOR_ENV if k in os.environ}

    def reparse(self, timeout: float = 60) -> None:
        """Ask the DAG processor to parse every DAG file of the stack now (each file's token from one of its DAGs).
        A request the API server fails (HTTP 5xx: its database busy) is asked again until ``timeout``."""
        assert self.airflow is not None
        deadline = time.monotonic() + timeout
        while True:
            status, body = self.airflow.call("GET", "/dags?limit=1000")
            dags = body.get("dags", []) if status == 200 and isinstance(body, dict) else []
            tokens = {d["fileloc"]: d["file_token"] for d in dags if d.get("file_token")}
            if tokens or time.monotonic() > deadline:
                break
            time.sleep(2)
        if not tokens:
            raise LoraflowError(f"the shared stack lists no DAG to reparse (HTTP {status}: {body})")
        for token in tokens.values():
            while True:  # a server error (SQLite locked by the processor's own write, on a loaded machine) passes
                status, body = self.airflow.call("PUT", f"/parseDagFile/{token}")
                if status == 201:
                    break
                if status < 500 or time.monotonic() > deadline:
                    raise LoraflowError(f"the reparse request was refused (HTTP {status}: {body})")
                time.sleep(2)

    def close(self) -> None:
        """Stop the stack (if it runs); a later ``use`` would start a new one."""
        self._exit.close()
        self.airflow = None

    def __enter__(self) -> SharedStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
