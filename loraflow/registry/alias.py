"""Moving a pipeline's champion alias (``{registry_uri}/{pipeline}/aliases/champion.json``).

Every move, by publish (the gate promoted a model) or by an operator (promote, rollback), is one
write of the alias object with the precondition ``if_generation_match``: the generation read before
the decision. Two moves decided from the same alias cannot both win: GCS answers the second with
412 and it raises ``PreconditionFailed`` (publish reads again and decides again; an operator's move
is refused, naming who moved the alias meanwhile). The alias records its move (``move``: an audit
event, ``loraflow.registry.audit``) and the move's ``sequence``; the event is appended to the trail
right after the write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loraflow.registry import audit, store
from loraflow.storage import artifacts, gcs

FORMAT = "loraflow.registry.store.alias/1"
NAME = store.CHAMPION


@dataclass(frozen=True)
class AliasState:
    """The alias as read: its object's generation (0: no alias yet) and contents."""

    uri: str
    generation: int
    data: dict[str, Any] | None

    @property
    def version(self) -> int | None:
        held = (self.data or {}).get("version")
        return held if isinstance(held, int) and not isinstance(held, bool) and held > 0 else None

    @property
    def sequence(self) -> int:
        """The sequence of the move that wrote the alias (0: an alias written before moves were counted)."""
        value = (self.data or {}).get("sequence")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def read(registry_uri: str, pipeline: str) -> AliasState:
    """The alias now; one that is not a JSON object (capped) is refused, naming it and the repair."""
    uri = store.alias_uri(registry_uri, pipeline)
    bucket, name = gcs.split_uri(uri)
    blob = gcs.client().bucket(bucket).get_blob(name)
    if blob is None:
        return AliasState(uri, 0, None)
    try:
        data = artifacts.read_json_object(uri, max_bytes=store.ALIAS_MAX_BYTES, blob=blob)
    except artifacts.JsonObjectError as exc:
        raise store.refused(uri, f"it {exc.problem}") from None
    held = (data or {}).get("version", 0)
    if not isinstance(held, int) or isinstance(held, bool) or held < 0:
        raise store.refused(uri, f"its version is {str(held)[:40]!r}, not a version number")
    return AliasState(uri, int(blob.generation), data)


def move(
    registry_uri: str,
    pipeline: str,
    state: AliasState,
    to_version: int,
    entry: dict[str, Any],
    *,
    action: str,
    actor: str,
    reason: str,
    via: str,
) -> dict[str, Any]:
    """Point the alias at ``to_version`` (whose version ``entry`` names its model and run) if it is still
    as ``state`` read it; the move's audit event, appended to the trail. Raises google-api-core's
    ``PreconditionFailed`` when the alias changed since it was read."""
    audit.record_pending(registry_uri, pipeline, state.data)  # a mover that died after its write
    event = audit.event(
        sequence=max(state.sequence, audit.last_sequence(registry_uri, pipeline)) + 1,
        action=action,
        from_version=state.version,
        to_version=to_version,
        actor=actor,
        reason=reason,
        via=via,
    )
    data = {
        "format": FORMAT,
        "alias": NAME,
        "version": to_version,
        "version_uri": store.version_uri(registry_uri, pipeline, to_version),
        "model_manifest": entry["model_manifest"],
        "model_fingerprint": entry["model_fingerprint"],
        "run_id": entry["run_id"],
        "updated_at": event["at"],
        "sequence": event["sequence"],
        "move": event,
    }
    bucket, name = gcs.split_uri(state.uri)
    gcs.client().bucket(bucket).blob(name).upload_from_string(
        json.dumps(data, indent=2, sort_keys=True),
        content_type="application/json",
        if_generation_match=state.generation,
    )
    audit.record(registry_uri, pipeline, event)
    return event
