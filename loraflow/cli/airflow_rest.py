"""Airflow's REST API v2, as the ``loraflow`` command uses it: runs of a DAG, their XComs, triggering.

Settings (a flag wins over its environment variable):

    --airflow-url       LORAFLOW_AIRFLOW_URL       default http://127.0.0.1:8080
    --airflow-user      LORAFLOW_AIRFLOW_USERNAME  with the password: a JWT from POST /auth/token
                        LORAFLOW_AIRFLOW_PASSWORD  (environment only: a flag would show in `ps`)
                        LORAFLOW_AIRFLOW_TOKEN     a JWT already issued (instead of user and password)

Every request carries ``Authorization: Bearer <JWT>``. A secret is never printed: errors name the URL,
the user and the setting to fix, never the password or the token. Only the standard library is used.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loraflow.errors import LoraflowError, excerpt

URL_ENV = "LORAFLOW_AIRFLOW_URL"
USER_ENV = "LORAFLOW_AIRFLOW_USERNAME"
PASSWORD_ENV = "LORAFLOW_AIRFLOW_PASSWORD"
TOKEN_ENV = "LORAFLOW_AIRFLOW_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8080"
TIMEOUT_S = 30.0


class AirflowUnreachable(LoraflowError):
    """No answer from Airflow's API server at the URL."""


class AirflowApiError(LoraflowError):
    """Airflow answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


@dataclass
class AirflowClient:
    url: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    timeout: float = TIMEOUT_S

    @classmethod
    def from_settings(
        cls, url: str | None = None, username: str | None = None, environ: Mapping[str, str] | None = None
    ) -> AirflowClient:
        env = os.environ if environ is None else environ
        return cls(
            url=checked_url(url or env.get(URL_ENV) or DEFAULT_URL),
            username=username or env.get(USER_ENV),
            password=env.get(PASSWORD_ENV),
            token=env.get(TOKEN_ENV),
        )

    # ------------------------------------------------------------------------------ transport

    def _bearer(self) -> str:
        if self.token:
            return self.token
        if not (self.username and self.password):
            raise LoraflowError(
                f"no credentials for Airflow at {self.url}: set {TOKEN_ENV} (a JWT), or {USER_ENV} and {PASSWORD_ENV}"
            )
        body = json.dumps({"username": self.username, "password": self.password}).encode()
        status, answer = self._send("POST", f"{self.url}/auth/token", body, {})
        if status in (401, 403):
            raise LoraflowError(
                f"Airflow at {self.url} refused the credentials of user {self.username!r} (HTTP {status}); "
                f"check {USER_ENV} and {PASSWORD_ENV}"
            )
        if status >= 400 or not isinstance(answer, dict) or "access_token" not in answer:
            raise AirflowApiError(status, f"Airflow at {self.url} gave no token at /auth/token (HTTP {status})")
        self.token = str(answer["access_token"])
        return self.token

    def _send(self, method: str, url: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, Any]:
        request = urllib.request.Request(
            url, body, {"Content-Type": "application/json", "Accept": "application/json", **headers}, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AirflowUnreachable(
                f"cannot reach Airflow at {self.url} ({reason}); start it, or point --airflow-url / {URL_ENV} "
                "at its API server"
            ) from None
        except http.client.HTTPException as exc:  # something listens there, but it does not speak HTTP
            raise AirflowUnreachable(
                f"what answers at {self.url} is not an HTTP server ({type(exc).__name__}); point --airflow-url / "
                f"{URL_ENV} at Airflow's API server (its port, {DEFAULT_URL} locally)"
            ) from None

    def call(self, method: str, path: str, body: Any = None, query: Mapping[str, Any] | None = None) -> Any:
        """``/api/v2{path}``'s JSON answer; an error status raises ``AirflowApiError`` with Airflow's detail."""
        url = f"{self.url}/api/v2{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = None if body is None else _request_body(body, f"{method} {path}")
        status, answer = self._send(method, url, data, {"Authorization": f"Bearer {self._bearer()}"})
        if status == 401:
            raise LoraflowError(f"Airflow at {self.url} refused the token (HTTP 401); set {TOKEN_ENV} to a valid one")
        if status >= 400:
            detail = answer.get("detail", answer) if isinstance(answer, dict) else answer
            raise AirflowApiError(status, f"Airflow at {self.url}: {method} {path}: HTTP {status}: {detail}")
        if not isinstance(answer, dict):  # every endpoint used here answers a JSON object
            raise AirflowApiError(
                status,
                f"{self.url} answered {method} {path} with no JSON object ({excerpt(answer)}); point --airflow-url / "
                f"{URL_ENV} at Airflow's API server",
            )
        return answer

    # ------------------------------------------------------------------------------ endpoints

    def dag(self, dag_id: str) -> dict[str, Any]:
        """The DAG's details (its params among them); an unknown DAG is named."""
        try:
            answer: dict[str, Any] = self.call("GET", f"/dags/{_quote(dag_id)}/details")
        except AirflowApiError as exc:
            if exc.status == 404:
                raise LoraflowError(
                    f"Airflow at {self.url} has no DAG {dag_id!r}: check the name (a spec's `name`) and "
                    "`loraflow validate`, or the import errors in Airflow's UI"
                ) from None
            raise
        return answer

    def runs(self, dag_id: str, limit: int) -> list[dict[str, Any]]:
        """The DAG's most recent runs, newest first."""
        self.dag(dag_id)
        answer = self.call("GET", f"/dags/{_quote(dag_id)}/dagRuns", query={"order_by": "-run_after", "limit": limit})
        return list(answer.get("dag_runs", []))

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        answer = self.call("GET", f"/dags/{_quote(dag_id)}/dagRuns/{_quote(run_id)}/taskInstances")
        return {ti["task_id"]: ti.get("state") for ti in answer.get("task_instances", [])}

    def xcom(self, dag_id: str, run_id: str, task_id: str) -> Any:
        """A task's return value, or None when it has none."""
        path = (
            f"/dags/{_quote(dag_id)}/dagRuns/{_quote(run_id)}/taskInstances/{_quote(task_id)}/xcomEntries/return_value"
        )
        try:
            answer = self.call("GET", path)
        except AirflowApiError as exc:
            if exc.status == 404:
                return None
            raise
        return answer.get("value") if isinstance(answer, dict) else None

    def trigger(self, dag_id: str, conf: dict[str, Any], unpause: bool = False) -> dict[str, Any]:
        if unpause:
            self.call("PATCH", f"/dags/{_quote(dag_id)}", {"is_paused": False})
        run: dict[str, Any] = self.call("POST", f"/dags/{_quote(dag_id)}/dagRuns", {"logical_date": None, "conf": conf})
        return run


def checked_url(url: str) -> str:
    """``url`` (without a trailing slash) if it is an http:// or https:// URL of a host, with a port
    from 0 to 65535 if it names one; else ``LoraflowError`` saying what to write."""
    fix = f"write the API server's URL, such as {DEFAULT_URL} (--airflow-url or {URL_ENV})"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  # reading it checks it: ValueError when out of range or no number
    except ValueError as exc:
        raise LoraflowError(f"the Airflow URL {excerpt(url)} cannot be read ({exc}); {fix}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or _NOT_IN_URLS.search(url):
        raise LoraflowError(f"the Airflow URL {excerpt(url)} is not an http:// or https:// URL of a host; {fix}")
    return url.rstrip("/")


# What no URL may hold (http.client refuses a request for one with a bare ValueError).
_NOT_IN_URLS = re.compile(r"[\x00-\x20\x7f]")


def _request_body(body: Any, what: str) -> bytes:
    """``body`` as JSON; NaN and Infinity refused (Python would write them, and no JSON reader takes them)."""
    try:
        return json.dumps(body, allow_nan=False).encode()
    except ValueError:
        raise LoraflowError(
            f"{what}: the request holds NaN or Infinity, which JSON has no value for; send finite numbers"
        ) from None


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode(errors="replace")[:500]
