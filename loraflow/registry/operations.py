"""Operating a pipeline's model registry: list its versions, promote one, roll the champion back.

The same functions serve the ``loraflow registry`` command and the ``loraflow_registry`` maintenance
DAG. A move is one precondition-guarded write of the champion alias (``loraflow.registry.alias``):
decided from the alias as read, refused if anyone moved it meanwhile (``ConcurrentMove``), recorded
in the append-only audit trail (``loraflow.registry.audit``: who, when, why, from which version to
which) and mirrored to Vertex AI Model Registry when the spec registers there. Nothing is deleted:
a rollback moves the alias back, every version and event stays.

- promote N: version N must exist and verify as the gate's champion does (its run's committed gate
  promoted it, judging the committed evaluation of its model; ``store.verified``) and its model's files
  must still be in GCS as its manifest records them (``verify.verify_artifact``); else it is refused.
- rollback: the champion goes to the newest version older than it that no rollback withdrew
  (``audit.withdrawn``), verified the same way; there must be one.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraflow.errors import ArtifactError, LoraflowError
from loraflow.registry import alias, audit, store
from loraflow.storage import artifacts
from loraflow.storage.verify import verify_artifact

if TYPE_CHECKING:
    from loraflow.registry.vertex import VertexModelRegistry
    from loraflow.spec.schema import PipelineSpec

ACTIONS = ("list", "promote", "rollback")


class RegistryOperationError(LoraflowError):
    """A registry operation was refused; nothing was changed."""


class UnknownVersion(RegistryOperationError):
    pass


class NothingToRollBack(RegistryOperationError):
    pass


class VersionDoesNotVerify(RegistryOperationError):
    pass


class ConcurrentMove(RegistryOperationError):
    pass


@dataclass(frozen=True)
class PipelineRegistry:
    """Where a pipeline's registry lives and what verifies it (its spec's artifact root)."""

    registry_uri: str
    pipeline: str
    artifact_root: str
    vertex: VertexModelRegistry | None = None

    @classmethod
    def for_spec(cls, spec: PipelineSpec) -> PipelineRegistry:
        vertex = None
        if spec.publish.vertex_model_registry is not None:
            from loraflow.registry import vertex as vertex_registry

            target = vertex_registry.Target.from_config(spec.publish.vertex_model_registry.model_dump(), spec.name)
            vertex = vertex_registry.VertexModelRegistry(target, spec.name)
        return cls(spec.registry_uri, spec.name, spec.artifact_root, vertex)


def default_actor() -> str:
    """Who runs the command, for the audit trail: ``$LORAFLOW_ACTOR``, else the local user."""
    return os.environ.get("LORAFLOW_ACTOR") or getpass.getuser()


# ------------------------------------------------------------------------------------------ list


#: What a version records, as the listing shows it: field -> (the types publish writes, what they are).
#: A field may be missing (versions registered before it was recorded), never of another type.
LISTED_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "run_id": ((str,), "text"),
    "created_at": ((str,), "text"),
    "metrics": ((dict,), "an object of names and figures"),
    "model_manifest": ((str,), "text"),
    "model_fingerprint": ((str,), "text"),
    "gate_manifest": ((str, type(None)), "text or null"),
    "eval_set_fingerprint": ((str, type(None)), "text or null"),
}
#: What an operator does about a version the listing cannot read whole.
VERSION_REPAIR = (
    "publish never writes it so: restore the object from the bucket's object history; promote, rollback and "
    "the gate verify a version from its run's commits, not from these fields"
)


def listing(reg: PipelineRegistry) -> dict[str, Any]:
    """Every version (oldest first) with its metrics and lineage, the champion, and the audit trail.

    What is malformed is named, never fatal: a version without its unreadable fields and a ``problem``
    naming them, the object and the repair; an audit object that is no event as such (``audit.read_trail``);
    an alias that is not one as ``alias_problem`` (with no champion)."""
    alias_problem = None
    try:
        state = alias.read(reg.registry_uri, reg.pipeline)
    except ArtifactError as exc:  # malformed (a 403 or an unreachable GCS still raises)
        state, alias_problem = alias.AliasState(store.alias_uri(reg.registry_uri, reg.pipeline), 0, None), str(exc)
    trail = audit.read_trail(reg.registry_uri, reg.pipeline, state.data)
    gone = audit.withdrawn(trail)
    versions = []
    for number, blob in sorted(store.versions(reg.registry_uri, reg.pipeline).items()):
        uri = store.version_uri(reg.registry_uri, reg.pipeline, number)
        row: dict[str, Any] = {"version": number, "champion": number == state.version, "withdrawn": number in gone}
        try:
            entry = artifacts.read_json_object(uri, max_bytes=store.VERSION_MAX_BYTES, blob=blob) or {}
        except artifacts.JsonObjectError as exc:
            versions.append({**row, "problem": f"{uri} {exc.problem}; {VERSION_REPAIR}"})
            continue
        versions.append({**row, **_listed_fields(entry, uri)})
    return {
        "pipeline": reg.pipeline,
        "registry": reg.registry_uri,
        "alias_uri": state.uri,
        "champion": state.version,
        **({"alias_problem": alias_problem} if alias_problem else {}),
        "versions": versions,
        "audit": trail,
    }


def _listed_fields(entry: dict[str, Any], uri: str) -> dict[str, Any]:
    """The fields of ``LISTED_FIELDS`` that ``entry`` holds as publish writes them, and a ``problem``
    naming the others (metrics keep the names and figures that are text and numbers)."""
    fields: dict[str, Any] = {}
    wrong = []
    for key, (types, what) in LISTED_FIELDS.items():
        if key not in entry:
            continue
        if isinstance(entry[key], types):
            fields[key] = entry[key]
        else:
            wrong.append(f"its {key} is {store.shown(entry[key], quoted=True)}, not {what}")
    metrics = fields.get("metrics", {})
    fields["metrics"] = {k: x for k, x in metrics.items() if _scalar(x)}
    if len(fields["metrics"]) < len(metrics):
        bad = sorted(k for k, x in metrics.items() if not _scalar(x))
        wrong.append(f"its metrics {', '.join(store.shown(k, quoted=True) for k in bad)} are not figures")
    fields["eval_set"] = fields.pop("eval_set_fingerprint", None)
    if wrong:
        fields["problem"] = f"{uri} is not a version as publish writes it: {'; '.join(wrong)}; {VERSION_REPAIR}"
    return fields


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str)) and not isinstance(value, bool)


def render(listed: dict[str, Any]) -> str:
    """The listing as text: a table of versions, then the audit trail. Every field read from storage is
    printed through ``store.shown`` (one line each, control characters escaped)."""
    champion = f"version {listed['champion']}" if listed["champion"] else "none yet"
    if listed.get("alias_problem"):
        champion = f"unreadable: {listed['alias_problem']}"
    lines = [f"registry of {listed['pipeline']} ({listed['registry']}); champion: {champion}"]
    lines.append(f"{'':2}{'version':>7}  {'created':<20}  {'run':<40}  metrics")
    for v in listed["versions"]:
        mark = "*" if v["champion"] else ("x" if v["withdrawn"] else " ")
        if "metrics" not in v:  # not a JSON object: no field of it was read
            lines.append(f"{mark} {v['version']:>7}  (unreadable: {v['problem']})")
            continue
        metrics = ", ".join(f"{store.shown(k)}={_figure(x)}" for k, x in sorted(v["metrics"].items()))
        created, run = store.shown(v.get("created_at", "?")), store.shown(v.get("run_id", "?"))
        lines.append(f"{mark} {v['version']:>7}  {created:<20}  {run:<40}  {metrics}")
        lines.append(f"{'':11}model {store.shown(v.get('model_manifest', '?'))}")
        lines.append(f"{'':11}gate  {store.shown(v.get('gate_manifest', '?'))}")
        if "problem" in v:
            lines.append(f"{'':11}problem: {v['problem']}")  # our words; the stored values in it went through shown
    if not listed["versions"]:
        lines.append("  (no versions: no run of this pipeline was promoted yet)")
    lines.append("* champion   x withdrawn by a rollback")
    lines.append("audit trail:" if listed["audit"] else "audit trail: (empty)")
    lines += ["  " + audit.describe(e) for e in listed["audit"]]
    return "\n".join(lines)


def _figure(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else store.shown(value)


# ------------------------------------------------------------------------------------------ moves


def promote(reg: PipelineRegistry, version: int, *, actor: str, reason: str, via: str) -> dict[str, Any]:
    """Make ``version`` the champion. The champion is verified like any other version; when its alias
    names it as publish writes it, promoting it changes nothing in GCS and mirrors it to Vertex again (how
    a failed mirror is repaired); an alias naming another model or run is rewritten (a move)."""
    _need_reason(reason, "promote")
    state = alias.read(reg.registry_uri, reg.pipeline)
    numbers = store.versions(reg.registry_uri, reg.pipeline)
    if version not in numbers:
        known = ", ".join(str(n) for n in sorted(numbers)) or "none"
        raise UnknownVersion(
            f"{reg.pipeline} has no registry version {version} (versions: {known}); "
            f"see `loraflow registry list {reg.pipeline}`"
        )
    entry = _verified(reg, version, "promote")
    if state.version == version and _names(state, entry):
        return _result(reg, "promote", None, version, note=f"version {version} is the champion already")
    event = _move(reg, state, version, entry, "promote", actor=actor, reason=reason, via=via)
    return _result(reg, "promote", event, version)


def rollback(reg: PipelineRegistry, *, actor: str, reason: str, via: str) -> dict[str, Any]:
    """Move the champion back to the newest older version no rollback withdrew."""
    _need_reason(reason, "rollback")
    state = alias.read(reg.registry_uri, reg.pipeline)
    if state.version is None:
        raise NothingToRollBack(
            f"{reg.pipeline} has no champion yet ({state.uri} does not exist): nothing to roll back"
        )
    gone = audit.withdrawn(audit.read_trail(reg.registry_uri, reg.pipeline, state.data))
    older = sorted((n for n in store.versions(reg.registry_uri, reg.pipeline) if n < state.version), reverse=True)
    candidates = [n for n in older if n not in gone]
    if not candidates:
        skipped = (
            f" (versions {', '.join(map(str, sorted(gone & set(older))))} were rolled back)"
            if gone & set(older)
            else ""
        )
        raise NothingToRollBack(
            f"{reg.pipeline}: the champion, version {state.version}, has no older version to roll back to{skipped}; "
            f"promote a version explicitly with `loraflow registry promote {reg.pipeline} N`"
        )
    target = candidates[0]
    entry = _verified(reg, target, "roll back to")
    event = _move(reg, state, target, entry, "rollback", actor=actor, reason=reason, via=via)
    return _result(reg, "rollback", event, target)


#: The longest reason an event records (the maintenance DAG's param has the same maxLength).
MAX_REASON_CHARS = 1000


def _need_reason(reason: str, action: str) -> None:
    if not reason.strip():
        raise RegistryOperationError(
            f"a {action} needs a reason for the audit trail: say why (e.g. --reason 'v3 answers worse on the new "
            "eval set'; the maintenance DAG's 'reason' param)"
        )
    if len(reason) > MAX_REASON_CHARS:
        raise RegistryOperationError(
            f"the reason has {len(reason)} characters; an audit event keeps at most {MAX_REASON_CHARS}: shorten it"
        )


def _verified(reg: PipelineRegistry, version: int, doing: str) -> dict[str, Any]:
    """Version ``version``'s entry, verified (its lineage and its model's files in GCS), or refused."""
    uri = store.version_uri(reg.registry_uri, reg.pipeline, version)
    fix = f"refusing to {doing} it; promote another version (`loraflow registry list {reg.pipeline}`)"

    def wrong(problem: str) -> VersionDoesNotVerify:
        return VersionDoesNotVerify(f"version {version} ({uri}) does not verify: {problem}; {fix}")

    try:
        entry = artifacts.read_json_object(uri, max_bytes=store.VERSION_MAX_BYTES)
    except artifacts.JsonObjectError as exc:
        raise wrong(f"it {exc.problem}") from None
    if entry is None:
        raise UnknownVersion(f"{reg.pipeline} has no registry version {version} ({uri} does not exist)")
    checked = store.verified(entry, version, uri, reg.pipeline, reg.artifact_root, wrong)
    try:
        model = verify_artifact(checked["model_manifest"])
    except ArtifactError as exc:
        raise wrong(f"its model: {exc}") from None
    if not model.ok:
        raise wrong(f"its model {model.manifest.prefix} no longer matches its manifest: " + "; ".join(model.problems))
    return checked


def _names(state: alias.AliasState, entry: dict[str, Any]) -> bool:
    """Whether the alias names the verified version ``entry`` as a move writes it (its URI, model and run)."""
    held = state.data or {}
    return all(held.get(k) == entry[k] for k in ("version_uri", "model_manifest", "model_fingerprint", "run_id"))


def _move(
    reg: PipelineRegistry, state: alias.AliasState, version: int, entry: dict[str, Any], action: str, **who: str
) -> dict[str, Any]:
    """``alias.move`` (``who``: actor, reason, via), a lost race refused as ``ConcurrentMove``."""
    from google.api_core.exceptions import PreconditionFailed

    try:
        return alias.move(reg.registry_uri, reg.pipeline, state, version, entry, action=action, **who)
    except PreconditionFailed:
        now = alias.read(reg.registry_uri, reg.pipeline)
        last = (now.data or {}).get("move")
        by = (
            f", moved by {store.shown(last['actor'])} at {store.shown(last['at'])} ({last['action']})"
            if audit.is_event(last)
            else ""
        )
        raise ConcurrentMove(
            f"the {alias.NAME} alias of {reg.pipeline} moved while this {action} was decided (it held version "
            f"{state.version}, now {now.version}{by}); nothing was changed by this {action}: see "
            f"`loraflow registry list {reg.pipeline}` and run it again if it still applies"
        ) from None


def _result(
    reg: PipelineRegistry, action: str, event: dict[str, Any] | None, version: int, note: str = ""
) -> dict[str, Any]:
    """What a move did (small: the CLI prints it, the DAG task pushes it to XCom), after mirroring it."""
    out: dict[str, Any] = {"pipeline": reg.pipeline, "action": action, "champion": version, "event": event}
    if note:
        out["note"] = note
    if reg.vertex is not None:
        try:
            vertex = reg.vertex.move_champion(version)
        except Exception as exc:  # the SDK's errors, an unreachable endpoint: the GCS move stands
            raise LoraflowError(
                f"the GCS registry's champion of {reg.pipeline} is version {version}, but mirroring it to Vertex AI "
                f"Model Registry ({reg.vertex.model_name}) failed: {type(exc).__name__}: {exc}; run `loraflow "
                f"registry promote {reg.pipeline} {version} --reason ...` again to mirror it (GCS is not moved twice)"
            ) from exc
        out["vertex_model"] = f"{vertex['model']}@{vertex['version_id']}"
        out["vertex_aliases"] = vertex["version_aliases"]
    return out


def summary_line(done: dict[str, Any]) -> str:
    """One line saying what a promote or rollback did (the CLI prints it, the DAG task logs it)."""
    event = done.get("event")
    line = f"{done['pipeline']}: " + (audit.describe(event) if event else done.get("note", "nothing moved"))
    if done.get("vertex_model"):
        line += f"; Vertex AI {done['vertex_model']} holds {', '.join(done['vertex_aliases'])}"
    return line
