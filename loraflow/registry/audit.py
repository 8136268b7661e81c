"""The champion alias's audit trail: every move, who made it, when, why, from which version to which.

Layout under ``{registry_uri}/{pipeline}/``: ``audit/NNNNNN.json``, one object per move of the alias,
numbered by the move's ``sequence`` (the alias records the sequence of the move that wrote it). Each
is written create-only (``if_generation_match=0``), so nothing rewrites an event, and nothing here
deletes one: the trail is append-only.

The alias write decides a move (``loraflow.registry.alias``); its event is written right after it,
from what the alias itself records. A mover that died between the two leaves an alias whose move
has no event yet: the next move writes that event before its own (``record_pending``), and a listing
shows it from the alias meanwhile, so no move is ever missing from the trail.

Anyone who can write the bucket can write here too: events are read with a byte cap and one that is
not what a move writes (``problem``), or is filed under another sequence, is listed as such, naming its
object and the repair, never trusted to decide a rollback's target. Every field is printed through
``store.shown``: a line break or a terminal escape code in a field cannot forge a line of the trail.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any, TypeGuard

from loraflow.registry.store import shown
from loraflow.storage import artifacts, gcs

FORMAT = "loraflow.registry.audit/1"
MAX_BYTES = 64 << 10
ACTIONS = ("publish", "promote", "rollback")
_NAME = re.compile(r"([0-9]{6,})\.json")  # fullmatch; ASCII digits only
#: What an operator does about an object of the trail that is not an event.
REPAIR = (
    "an event is written once and never rewritten: restore the object from the bucket's object history "
    "(until then a rollback does not count it)"
)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def trail_uri(registry_uri: str, pipeline: str) -> str:
    return gcs.join(registry_uri, pipeline, "audit")


def event_uri(registry_uri: str, pipeline: str, sequence: int) -> str:
    return gcs.join(trail_uri(registry_uri, pipeline), f"{sequence:06d}.json")


def event(
    *,
    sequence: int,
    action: str,
    from_version: int | None,
    to_version: int,
    actor: str,
    reason: str,
    via: str,
) -> dict[str, Any]:
    """One move of the champion alias, as the alias and the trail record it."""
    if action not in ACTIONS:
        raise ValueError(f"unknown registry action {action!r}; one of {', '.join(ACTIONS)}")
    return {
        "format": FORMAT,
        "sequence": sequence,
        "action": action,
        "from_version": from_version,
        "to_version": to_version,
        "actor": actor,
        "reason": reason,
        "via": via,
        "at": now(),
    }


def record(registry_uri: str, pipeline: str, move: dict[str, Any]) -> bool:
    """Append ``move`` to the trail (create-only); False when its sequence is recorded already."""
    from google.api_core.exceptions import PreconditionFailed

    try:
        artifacts.write_json(event_uri(registry_uri, pipeline, int(move["sequence"])), move, create_only=True)
        return True
    except PreconditionFailed:
        return False


def record_pending(registry_uri: str, pipeline: str, alias: dict[str, Any] | None) -> None:
    """Write the event of the move that wrote ``alias`` (the alias object) if it is not in the trail yet."""
    move = (alias or {}).get("move")
    if isinstance(move, dict) and is_event(move):
        record(registry_uri, pipeline, move)


def is_event(value: Any) -> TypeGuard[dict[str, Any]]:
    """Whether ``value`` is a move as ``event`` makes it (what a rollback may rely on)."""
    return problem(value) is None


def problem(value: Any) -> str | None:
    """What makes ``value`` other than a move as ``event`` makes it; None when it is one."""
    if not isinstance(value, dict):
        return "it is not a JSON object"
    if value.get("format") != FORMAT:
        return _wrong(value, "format", FORMAT)
    if value.get("action") not in ACTIONS:
        return _wrong(value, "action", f"one of {', '.join(ACTIONS)}")
    for key in ("sequence", "from_version", "to_version"):
        if not (_number(value.get(key)) or (key == "from_version" and value.get(key) is None)):
            return _wrong(value, key, "a number")
    for key in ("actor", "reason", "via", "at"):
        if not isinstance(value.get(key), str):
            return _wrong(value, key, "text")
    return None


def _wrong(value: dict[str, Any], key: str, what: str) -> str:
    return f"its {key} is {shown(value[key], quoted=True)}, not {what}" if key in value else f"it has no {key}"


def _listing(registry_uri: str, pipeline: str) -> list[tuple[int, str, Any]]:
    """(sequence, URI, blob) of every object named as an event, in sequence order."""
    prefix_uri = trail_uri(registry_uri, pipeline)
    bucket, base = gcs.split_uri(prefix_uri)
    found = []
    for blob in gcs.client().list_blobs(bucket, prefix=base + "/"):
        name = blob.name[len(base) + 1 :]
        match = _NAME.fullmatch(name)
        if match:
            found.append((int(match.group(1)), gcs.join(prefix_uri, name), blob))
    return sorted(found, key=lambda item: item[0])


def last_sequence(registry_uri: str, pipeline: str) -> int:
    """The highest sequence in the trail (0 when it is empty)."""
    listing = _listing(registry_uri, pipeline)
    return listing[-1][0] if listing else 0


def read_trail(registry_uri: str, pipeline: str, alias: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every event of the trail, oldest first; with ``alias``, its move too when the trail lacks it.

    An object that is not an event of this trail is listed as ``{"sequence": N, "uri": ..., "problem":
    "..."}``, the problem naming the object and the repair."""
    events: dict[int, dict[str, Any]] = {}
    for sequence, uri, blob in _listing(registry_uri, pipeline):
        try:
            data = artifacts.read_json_object(uri, max_bytes=MAX_BYTES, blob=blob)
        except artifacts.JsonObjectError as exc:
            events[sequence] = _unreadable(sequence, uri, f"it {exc.problem}")
            continue
        wrong = problem(data)
        if wrong is None and (data or {}).get("sequence") != sequence:
            wrong = f"it holds the event of sequence {(data or {}).get('sequence')}, filed under {sequence}"
        events[sequence] = dict(data or {}) if wrong is None else _unreadable(sequence, uri, wrong)
    pending = (alias or {}).get("move")
    if isinstance(pending, dict) and is_event(pending) and pending["sequence"] not in events:
        events[pending["sequence"]] = {**pending, "pending": True}
    return [events[k] for k in sorted(events)]


def _unreadable(sequence: int, uri: str, wrong: str) -> dict[str, Any]:
    return {"sequence": sequence, "uri": uri, "problem": f"{uri} is not an event of this trail: {wrong}; {REPAIR}"}


def withdrawn(events: Iterable[dict[str, Any]]) -> set[int]:
    """The versions a rollback moved the champion off and no later move put back: a rollback skips
    them, and a retried publish does not make them champion again."""
    out: set[int] = set()
    for move in events:
        if not is_event(move):
            continue
        if move["action"] == "rollback" and move["from_version"] is not None:
            out.add(move["from_version"])
        else:
            out.discard(move["to_version"])
    return out


def describe(move: dict[str, Any]) -> str:
    """One line of the trail, as a person reads it: every field from storage through ``shown``."""
    if "problem" in move:
        return f"#{move['sequence']:<4} (unreadable: {move['problem']})"  # its stored values went through shown
    source = f"v{move['from_version']}" if move.get("from_version") is not None else "(none)"
    pending = "  [event not yet written; from the alias]" if move.get("pending") else ""
    return (
        f"#{move['sequence']:<4} {shown(move['at'])}  {move['action']:<8} {source} -> v{move['to_version']}  "
        f"by {shown(move['actor'])} ({shown(move['via'])}): {shown(move['reason'], quoted=True)}{pending}"
    )


def _number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
