"""What each recent run of a pipeline decided, from Airflow's REST API (``loraflow runs``).

A pipeline run's verdict comes from its tasks' XComs: the gate's summary (promote, metric, base,
tuned, reason) and publish's (the registry version). A run that failed names the tasks that failed;
a run of another DAG (the registry's maintenance DAG) shows its task's result.
"""

from __future__ import annotations

from typing import Any

from loraflow.cli.airflow_rest import AirflowClient
from loraflow.storage.summaries import GateSummary, PublishSummary, SummaryError

FAILED = {"failed", "upstream_failed"}


def recent(client: AirflowClient, dag_id: str, limit: int) -> list[dict[str, Any]]:
    """The DAG's last ``limit`` runs, newest first: id, state, when, who, and the verdict."""
    out = []
    for run in client.runs(dag_id, limit):
        run_id = run["dag_run_id"]
        out.append(
            {
                "run_id": run_id,
                "state": run.get("state"),
                "start_date": run.get("start_date"),
                "end_date": run.get("end_date"),
                "triggered_by": run.get("triggering_user_name") or run.get("run_type"),
                "verdict": verdict(client, dag_id, run_id, run.get("state")),
            }
        )
    return out


def verdict(client: AirflowClient, dag_id: str, run_id: str, state: str | None) -> str:
    states = client.task_states(dag_id, run_id)
    failed = sorted(t for t, s in states.items() if s in FAILED)
    gate = client.xcom(dag_id, run_id, "gate") if "gate" in states else None
    if isinstance(gate, dict) and isinstance(gate.get("summary"), dict):
        try:
            said = _gate(gate["summary"], client.xcom(dag_id, run_id, "publish") if "publish" in states else None)
        except SummaryError as exc:  # this run's line says it; the other runs are still listed
            said = f"no verdict: {exc}"
        return said + (f" (failed: {', '.join(failed)})" if failed else "")
    if failed:
        return f"failed at {', '.join(failed)}"
    if len(states) == 1:  # a one-task DAG (the registry's maintenance DAG): its result
        (task,) = states
        result = client.xcom(dag_id, run_id, task)
        if isinstance(result, dict) and result.get("summary"):
            return str(result["summary"])
    return "running" if state in ("queued", "running") else "no verdict (no gate ran)"


def _gate(summary: dict[str, Any], published: Any) -> str:
    decision = GateSummary.from_object(summary, "the gate task's summary (XCom)")
    outcome = PublishSummary.from_xcom(published)
    figures = f"{decision.metric or 'metric'} {_n(decision.base)} -> {_n(decision.tuned)}"
    if decision.promote:
        where = f" as version {outcome.version}" if outcome and outcome.version else ""
        return f"promoted{where}: {figures}"
    return f"not promoted: {figures}; {decision.reason}".rstrip("; ")


def _n(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"
