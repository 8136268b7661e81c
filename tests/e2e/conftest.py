"""Fixtures the end-to-end modules share."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.dev import local_postgres
from loraflow.dev.db_template import DB_TEMPLATE_ENV
from loraflow.dev.local_celery import CeleryWorkers
from loraflow.dev.local_gcs import free_port
from loraflow.dev.shared_stack import SharedStack, together
from loraflow.spec.schema import load_spec
from tests.planted_faults import PlantedFaults
from tests.vertex_standin import endpoint_env

REPO = Path(__file__).resolve().parents[2]
SHARED = "shared_stack"
# The DAG whose OpenLineage events the shared stack writes (test_tiny_pipeline.py follows its runs' lineage).
LINEAGE_DAG = load_spec(REPO / "pipelines" / "tiny-llama-lora.yaml").name
DISTRIBUTED = "distributed_stack"
STACKS = (SHARED, DISTRIBUTED)
# For each shared stack (its fixture's name), the modules (node ids) whose tests use it and have not all run yet.
_STACK_USERS = pytest.StashKey[dict[str, set[str]]]()


@pytest.fixture(scope="session", autouse=True)
def airflow_db_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's template metadata database (``loraflow.dev.db_template``): the first stack on SQLite
    migrates it, every later one (a demo the test starts too) copies it instead of migrating its own."""
    folder = tmp_path_factory.mktemp("airflow-db-template")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(DB_TEMPLATE_ENV, str(folder))
        yield folder


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _after(items: list[pytest.Item]) -> dict[str, str]:
    """Each module (node id) with a ``CACHE_FROM`` (the ``__name__`` of the module whose cached stages it
    takes), mapped to that module's node id where it was collected."""
    modules = {getattr(i, "module", None): _module(i) for i in items}
    names = {module.__name__: node for module, node in modules.items() if module is not None}
    return {
        node: names[module.CACHE_FROM] for module, node in modules.items() if getattr(module, "CACHE_FROM", "") in names
    }


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that use one shared stack run one after another (where the first of them would run),
    so that the stack is up only while they run: it stops after the last of them. A module with a
    ``CACHE_FROM`` (``SharedStack.use``'s ``cache_from``) runs right after that module."""
    users = {name: {_module(i) for i in items if name in getattr(i, "fixturenames", ())} for name in STACKS}
    config.stash[_STACK_USERS] = users
    after = _after(items)
    for sharing in users.values():
        if sharing:
            order = together([_module(item) for item in items], sharing, after)
            items[:] = [items[i] for i in order]


def _release(request: pytest.FixtureRequest, name: str, stack: SharedStack) -> None:
    """Close ``stack`` once the last module that uses it (its fixture ``name``) is done."""
    left = request.config.stash.get(_STACK_USERS, {}).get(name, set())
    left.discard(request.node.nodeid)
    if not left:
        stack.close()


@pytest.fixture(scope="session")
def shared_stack_lineage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared stack's OpenLineage events go: the provider's file transport, one JSON file per
    event, for the runs of ``LINEAGE_DAG`` only (test_tiny_pipeline.py follows their lineage)."""
    return tmp_path_factory.mktemp("lineage")


@pytest.fixture(scope="session")
def shared_stack_vertex_port() -> int:
    """Where test_vertex_pipeline.py's Vertex AI stand-in will listen: the shared stack's processes (workers,
    triggerer) take its endpoint as they start, before the stand-in runs; a spec whose stages run locally
    never calls it."""
    return free_port()


@pytest.fixture(scope="session")
def planted_faults(tmp_path_factory: pytest.TempPathFactory) -> PlantedFaults:
    return PlantedFaults(tmp_path_factory.mktemp("fault-state"))


@pytest.fixture(scope="session")
def _shared_stack(
    tmp_path_factory: pytest.TempPathFactory,
    airflow_db_template: Path,
    shared_stack_lineage: Path,
    shared_stack_vertex_port: int,
    planted_faults: PlantedFaults,
) -> Iterator[SharedStack]:
    vertex = endpoint_env(f"http://127.0.0.1:{shared_stack_vertex_port}", 2)
    # The Vertex module restarts the triggerer: the new one takes a deferred task over once the old one's
    # heartbeat is this many seconds old (Airflow's default: 30).
    env = vertex | {"AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "10"}
    env |= {
        # OpenLineage on, as a user turns it on: the provider's [openlineage] transport, its file transport.
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
            {"type": "file", "log_file_path": str(shared_stack_lineage / "ol")}
        ),
        # The listener emits from a child of the task, killed after this many seconds (default 10: a loaded
        # 2-core machine can take longer to read the manifest and write the event).
        "AIRFLOW__OPENLINEAGE__EXECUTION_TIMEOUT": "60",
        # Events of the one DAG whose lineage a test follows, none of the others' runs (each task's would
        # fork a child that reads its manifest and writes two events): the provider's emission policy, as
        # an operator scopes OpenLineage to some DAGs.
        "AIRFLOW__OPENLINEAGE__EMISSION_POLICY": json.dumps(
            [{"scope": {}, "controls": {"emit": False}}, {"scope": {"dag_id": LINEAGE_DAG}, "controls": {"emit": True}}]
        ),
    }
    # The fault module's kills (its pipeline's steps only) and secret, which every process takes as it starts.
    env |= planted_faults.env
    with SharedStack(tmp_path_factory.mktemp("shared-stack"), env) as stack:
        yield stack


@pytest.fixture(scope="module")
def shared_stack(request: pytest.FixtureRequest, _shared_stack: SharedStack) -> Iterator[SharedStack]:
    """One GCS emulator + Airflow (``loraflow.dev.shared_stack``) for the modules that ask for it, instead of
    one each: a module calls ``shared_stack.use(__name__, *its_specs)`` for the Airflow, with DAG names and an
    artifact root of its own (or, with ``cache_from`` and a ``CACHE_FROM``, the root of a module that runs
    before it, whose cached stages its runs take). Stopped after the last module that uses it."""
    yield _shared_stack
    _release(request, SHARED, _shared_stack)


@pytest.fixture(scope="session")
def _distributed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStack]:
    home = tmp_path_factory.mktemp("distributed-stack")
    with SharedStack(home, database=local_postgres.running, celery=CeleryWorkers()) as stack:
        yield stack


@pytest.fixture(scope="module")
def distributed_stack(request: pytest.FixtureRequest, _distributed_stack: SharedStack) -> Iterator[SharedStack]:
    """Airflow distributed as production runs it, shared by the modules that ask for it as ``shared_stack`` is
    (``use(__name__, *its_specs)``, DAG names and an artifact root of its own): the CeleryExecutor with a Redis
    broker and ``CeleryWorkers()``'s workers (two of two task slots: four tasks at once, as the other stacks'
    LocalExecutor runs; they share no disk), on a throwaway PostgreSQL
    (``loraflow.dev.local_postgres``, installed from Debian's packages when missing) started with the stack.
    A module that loses a worker replaces it before it ends (``LocalAirflow.replace_worker``).
    Stopped, PostgreSQL with it, after the last module that uses it."""
    yield _distributed_stack
    _release(request, DISTRIBUTED, _distributed_stack)
