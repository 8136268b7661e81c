"""The ``loraflow`` commands for daily work: ``registry``, ``runs``, ``trigger``, ``verify``.

``registry`` and ``verify`` talk to GCS (the emulator when ``STORAGE_EMULATOR_HOST`` is set);
``runs`` and ``trigger`` to Airflow's REST API (loraflow/cli/airflow_rest.py says how to point them at it).
Each prints one line naming what could not be reached and what to set, and exits 1, when it cannot
reach them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loraflow.cli import airflow_rest
from loraflow.errors import LoraflowError, excerpt
from loraflow.spec.locate import PIPELINES_DEFAULT, pipelines_dir

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"


# ------------------------------------------------------------------------------------------- GCS


@contextmanager
def gcs_errors() -> Iterator[None]:
    """Turn "GCS cannot be reached / no credentials" into one line that says what to set."""
    emulator = os.environ.get(EMULATOR_ENV)
    if emulator:
        _check_emulator(emulator)
    try:
        yield
    except LoraflowError:
        raise
    except Exception as exc:
        problem = _gcs_problem(exc)
        if problem is None:
            raise
        raise LoraflowError(problem) from None


def _check_emulator(host: str) -> None:
    """The emulator ``STORAGE_EMULATOR_HOST`` names answers HTTP; else one line saying what to set."""
    address, port, secure = _emulator_address(host)
    start = f"start the emulator (`make ui` or `python -m loraflow.dev.local_gcs`) or unset {EMULATOR_ENV} to use GCS itself"
    try:
        with socket.create_connection((address, port), timeout=5):
            pass
        if not secure:  # a TLS emulator is only connected to: its certificate is its own business
            _answers_http(address, port)
    except OSError as exc:
        raise LoraflowError(f"cannot reach GCS at {host} ({EMULATOR_ENV}): {exc.strerror or exc}; {start}") from None
    except http.client.HTTPException as exc:
        raise LoraflowError(
            f"what answers at {host} ({EMULATOR_ENV}) is not an HTTP server ({type(exc).__name__}); point "
            f"{EMULATOR_ENV} at the emulator's port, or {start}"
        ) from None


def _emulator_address(host: str) -> tuple[str, int, bool]:
    """(host name, port, https?) of ``STORAGE_EMULATOR_HOST`` (``http://HOST:PORT`` or ``HOST:PORT``)."""
    fix = f"set {EMULATOR_ENV} to the emulator's URL, such as http://127.0.0.1:4443, or unset it to use GCS itself"
    try:
        parsed = urllib.parse.urlsplit(host if "://" in host else f"http://{host}")
        port = parsed.port  # ValueError when out of range or no number
    except ValueError as exc:
        raise LoraflowError(f"{EMULATOR_ENV} {excerpt(host)} cannot be read ({exc}); {fix}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise LoraflowError(f"{EMULATOR_ENV} {excerpt(host)} is not an http:// URL of a host; {fix}")
    secure = parsed.scheme == "https"
    return parsed.hostname, port or (443 if secure else 80), secure


def _answers_http(address: str, port: int) -> None:
    connection = http.client.HTTPConnection(address, port, timeout=5)
    try:
        connection.request("GET", "/")
        connection.getresponse().close()
    finally:
        connection.close()


def _gcs_problem(exc: Exception) -> str | None:
    from google.api_core import exceptions as api
    from google.auth import exceptions as auth

    if isinstance(exc, auth.DefaultCredentialsError):
        return (
            "no Google credentials for GCS: run `gcloud auth application-default login`, set "
            f"GOOGLE_APPLICATION_CREDENTIALS, or {EMULATOR_ENV} for the local emulator"
        )
    if isinstance(exc, (auth.TransportError, ConnectionError)) or type(exc).__name__ == "ConnectionError":
        return f"cannot reach Google Cloud Storage ({type(exc).__name__}: {str(exc)[:200]}); check the network"
    if isinstance(exc, (api.Forbidden, api.Unauthorized)):
        return f"GCS refused access ({exc.code}: {exc.message}); check the credentials' roles on the bucket"
    return None


# -------------------------------------------------------------------------------------- registry


def cmd_registry(args: argparse.Namespace) -> int:
    from loraflow.registry import operations
    from loraflow.spec.locate import spec_named

    reg = operations.PipelineRegistry.for_spec(spec_named(args.pipeline, args.pipelines))
    actor, via = getattr(args, "actor", None) or operations.default_actor(), "cli"
    with gcs_errors():
        if args.action == "list":
            listed = operations.listing(reg)
            print(json.dumps(listed, indent=2) if args.json else operations.render(listed))
            return 0
        if args.action == "promote":
            done = operations.promote(reg, args.version, actor=actor, reason=args.reason, via=via)
        else:
            done = operations.rollback(reg, actor=actor, reason=args.reason, via=via)
    print(json.dumps(done, indent=2) if args.json else operations.summary_line(done))
    return 0


# ------------------------------------------------------------------------------------------ verify


def cmd_verify(args: argparse.Namespace) -> int:
    from loraflow.storage.verify import verify_artifact

    with gcs_errors():
        checked = verify_artifact(args.uri, download=args.download)
    how = "downloaded and checksummed" if checked.downloaded else "sizes and crc32c as GCS stores them"
    stage = checked.manifest.data.get("stage", "?")
    if checked.ok:
        print(
            f"ok: {checked.checked} file(s) of {stage} at {checked.manifest.prefix} match {checked.manifest.uri} ({how})"
        )
        return 0
    print(f"NOT OK: {checked.manifest.prefix} ({stage}) does not match its manifest ({how}):", file=sys.stderr)
    for problem in checked.problems:
        print(f"  - {problem}", file=sys.stderr)
    return 1


# ------------------------------------------------------------------------------------ runs, trigger


def _client(args: argparse.Namespace) -> airflow_rest.AirflowClient:
    return airflow_rest.AirflowClient.from_settings(args.airflow_url, args.airflow_user)


def cmd_runs(args: argparse.Namespace) -> int:
    from loraflow.cli.run_verdicts import recent

    client = _client(args)
    runs = recent(client, args.pipeline, args.limit)
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    print(f"{args.pipeline}: {len(runs)} most recent run(s) at {client.url}")
    for run in runs:
        print(
            f"{run['run_id']:<44} {run['state'] or '?':<8} {run['start_date'] or '-':<34} {run['triggered_by'] or '-'}"
        )
        print(f"    {run['verdict']}")
    return 0


def cmd_trigger(args: argparse.Namespace) -> int:
    from loraflow.cli.dag_params import conf_from

    client = _client(args)
    details = client.dag(args.pipeline)
    conf = conf_from(args.pipeline, details.get("params") or {}, args.param)
    run = client.trigger(args.pipeline, conf, unpause=args.unpause)
    print(f"triggered {args.pipeline}: run {run['dag_run_id']} ({run.get('state')}) with {json.dumps(conf)}")
    if details.get("is_paused") and not args.unpause:
        print(f"note: {args.pipeline} is paused: the run waits until it is unpaused (--unpause does it)")
    print(f"see it: {client.url}/dags/{args.pipeline}/runs/{urllib.parse.quote(run['dag_run_id'], safe='')}")
    return 0


# -------------------------------------------------------------------------------------------- parser


def add_commands(sub: Any) -> None:
    """Add ``registry``, ``runs``, ``trigger`` and ``verify`` to the ``loraflow`` parser's subcommands."""
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--pipelines",
        type=Path,
        default=pipelines_dir(),
        help=f"folder of the pipeline specs (default: {PIPELINES_DEFAULT})",
    )
    where.add_argument("--json", action="store_true", help="print JSON")
    who = argparse.ArgumentParser(add_help=False)
    who.add_argument("--reason", required=True, help="why: recorded in the audit trail (required)")
    who.add_argument("--actor", help="who, for the audit trail (default: $LORAFLOW_ACTOR or your user name)")

    r = sub.add_parser(
        "registry",
        help="list a pipeline's registered models; promote one; roll the champion back (GCS)",
        description="A pipeline's model registry in GCS: every version with its metrics and lineage, the champion "
        "alias and its audit trail. promote and rollback move the alias (never deleting anything), guarded "
        "against a concurrent move, recorded with who, when and why, mirrored to Vertex AI Model Registry when "
        "the spec registers there.",
    )
    actions = r.add_subparsers(dest="action", required=True)
    actions.add_parser("list", parents=[where], help="versions, metrics, lineage, champion, audit trail").add_argument(
        "pipeline", help="pipeline name (or its spec file)"
    )
    promote = actions.add_parser("promote", parents=[where, who], help="make a version the champion (verified first)")
    promote.add_argument("pipeline", help="pipeline name (or its spec file)")
    promote.add_argument("version", type=int, help="registry version number (see `loraflow registry list`)")
    rollback = actions.add_parser(
        "rollback", parents=[where, who], help="move the champion back to the previous version"
    )
    rollback.add_argument("pipeline", help="pipeline name (or its spec file)")
    r.set_defaults(fn=cmd_registry)

    airflow = argparse.ArgumentParser(add_help=False)
    airflow.add_argument(
        "--airflow-url",
        help=f"Airflow API server (default: ${airflow_rest.URL_ENV} or {airflow_rest.DEFAULT_URL})",
    )
    airflow.add_argument(
        "--airflow-user",
        help=f"user for a token (default: ${airflow_rest.USER_ENV}; the password only from "
        f"${airflow_rest.PASSWORD_ENV}; or a JWT in ${airflow_rest.TOKEN_ENV})",
    )
    runs = sub.add_parser("runs", parents=[airflow], help="recent runs of a pipeline and their verdicts (Airflow REST)")
    runs.add_argument("pipeline", help="pipeline (DAG) name")
    runs.add_argument("--limit", type=int, default=10, help="how many runs, newest first (default 10)")
    runs.add_argument("--json", action="store_true", help="print JSON")
    runs.set_defaults(fn=cmd_runs)

    trigger = sub.add_parser(
        "trigger",
        parents=[airflow],
        help="trigger a pipeline run (Airflow REST), params checked against the DAG's first",
        epilog="Example: loraflow trigger tiny-llama-lora --param training_steps=100 --param lora_rank=8",
    )
    trigger.add_argument("pipeline", help="pipeline (DAG) name")
    trigger.add_argument(
        "--param", "-p", action="append", default=[], metavar="KEY=VALUE", help="a trigger param (repeatable)"
    )
    trigger.add_argument("--unpause", action="store_true", help="unpause the DAG first (a paused DAG's run waits)")
    trigger.set_defaults(fn=cmd_trigger)

    verify = sub.add_parser(
        "verify", help="re-check a committed artifact in GCS against its manifest (files, sizes, checksums)"
    )
    verify.add_argument("uri", help="gs:// prefix of a stage's output, or its _MANIFEST.json")
    verify.add_argument("--download", action="store_true", help="also download every file and checksum it here")
    verify.set_defaults(fn=cmd_verify)
