"""Staged checkpoints of several hosts (``checkpoint_sync.HostSyncer``): each host uploads its own part,
host 0 commits a step once every host has uploaded it, and a resume fetches a host's own part of the
newest committed step only.

Two threads stand in for two hosts, each with its own local directory; ``agree`` is the collective
(in lora_sft, ``process_allgather`` of every host's newest uploaded step), here a barrier between the
threads. The real thing, jax.distributed processes as separate hosts, is tests/trainer/test_multihost_sft.py.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from loraflow.errors import ArtifactError
from loraflow.storage import artifacts, checkpoint_sync

HOSTS = 2
HANG_GUARD = 120  # seconds a broken protocol may block a thread before the test fails instead of hanging


class Collective:
    """``agree`` for each host: blocks until every host has called it, then returns every host's value."""

    def __init__(self, hosts: int) -> None:
        self.values = [0] * hosts
        self.entered = [threading.Event() for _ in range(hosts)]
        self.barrier = threading.Barrier(hosts)

    def of(self, host: int) -> Callable[[int], list[int]]:
        def agree(value: int) -> list[int]:
            self.values[host] = value
            self.entered[host].set()
            self.barrier.wait(HANG_GUARD)
            seen = list(self.values)
            self.barrier.wait(HANG_GUARD)  # nobody overwrites a value before every host has read them all
            return seen

        return agree


def _finalised_step(local: Path, step: int, host: int) -> None:
    """What Orbax leaves on a host's disk for a step: that host's own shards and the metadata."""
    (local / str(step) / "model_params" / f"ocdbt.process_{host}").mkdir(parents=True)
    (local / str(step) / "model_params" / f"ocdbt.process_{host}" / "d").write_bytes(f"{step}:{host}".encode())
    (local / str(step) / "model_params" / "_METADATA").write_text(f"meta {step}")


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test through the list
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def test_a_step_is_committed_once_and_only_after_every_host_uploaded_its_part(gcs_bucket: str, tmp_path: Path) -> None:
    remote = f"{gcs_bucket}/p/run-1/lora_sft/_checkpoints"
    collective = Collective(HOSTS)
    local = [tmp_path / f"host{i}" / "ckpt" for i in range(HOSTS)]
    syncers = [checkpoint_sync.HostSyncer(local[i], remote, i, HOSTS, collective.of(i), keep=2) for i in range(HOSTS)]
    for host in range(HOSTS):
        _finalised_step(local[host], 2, host)

    # Host 0 uploads its part and waits for the others: step 2 must not be committed yet.
    first, errors0 = _in_thread(syncers[0].poll)
    while not collective.entered[0].is_set() and first.is_alive():
        collective.entered[0].wait(0.05)
    assert artifacts.read_json(f"{remote}/2/host-0/{checkpoint_sync.HOST_MARKER}") is not None
    assert artifacts.read_json(f"{remote}/2/{checkpoint_sync.MARKER}") is None, "committed before host 1 uploaded"
    assert checkpoint_sync.remote_steps(remote) == []

    second, errors1 = _in_thread(syncers[1].poll)
    first.join(HANG_GUARD)
    second.join(HANG_GUARD)
    assert not first.is_alive() and not second.is_alive() and not errors0 and not errors1, (errors0, errors1)
    assert checkpoint_sync.remote_steps(remote) == [2]
    marker = artifacts.read_json(f"{remote}/2/{checkpoint_sync.MARKER}")
    assert marker["hosts"] == HOSTS
    assert set(marker["files"]) == {
        f"host-{h}/model_params/{name}" for h in range(HOSTS) for name in ("_METADATA", f"ocdbt.process_{h}/d")
    }

    # A resume on new hosts: each fetches its own part only, checked against the commit marker.
    for host in range(HOSTS):
        fresh = tmp_path / f"new{host}"
        assert checkpoint_sync.download_latest(remote, fresh, host=host, hosts=HOSTS) == 2
        files = sorted(p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file())
        assert files == ["2/model_params/_METADATA", f"2/model_params/ocdbt.process_{host}/d"]
        assert (fresh / "2" / "model_params" / f"ocdbt.process_{host}" / "d").read_bytes() == f"2:{host}".encode()


def test_a_resume_never_takes_a_step_some_host_did_not_upload(gcs_bucket: str, tmp_path: Path) -> None:
    """Step 4: host 0's part uploaded, host 1's files uploaded but not its marker (it died): not committed;
    every host resumes from step 2, the newest committed one."""
    remote = f"{gcs_bucket}/ck"
    for host in range(HOSTS):
        _finalised_step(tmp_path / f"h{host}", 2, host)
        checkpoint_sync.upload_host_part(tmp_path / f"h{host}", remote, 2, host, HOSTS)
    checkpoint_sync.commit_step(remote, 2, HOSTS)
    for host in range(HOSTS):
        _finalised_step(tmp_path / f"h{host}", 4, host)
    checkpoint_sync.upload_host_part(tmp_path / "h0", remote, 4, 0, HOSTS)
    artifacts.upload_tree(tmp_path / "h1" / "4", f"{remote}/4/host-1")  # its files, no marker

    with pytest.raises(ArtifactError, match="host 1's part has no"):
        checkpoint_sync.commit_step(remote, 4, HOSTS)
    assert checkpoint_sync.remote_steps(remote) == [2]
    for host in range(HOSTS):
        assert checkpoint_sync.download_latest(remote, tmp_path / f"new{host}", host=host, hosts=HOSTS) == 2
    assert not (tmp_path / "new0" / "4").exists()


def test_a_checkpoint_of_n_hosts_is_refused_by_a_run_of_another_count(gcs_bucket: str, tmp_path: Path) -> None:
    """Each host's part holds the shards of that host under that host count: no other count can restore it."""
    remote = f"{gcs_bucket}/ck"
    for host in range(HOSTS):
        _finalised_step(tmp_path / f"h{host}", 2, host)
        checkpoint_sync.upload_host_part(tmp_path / f"h{host}", remote, 2, host, HOSTS)
    checkpoint_sync.commit_step(remote, 2, HOSTS)
    with pytest.raises(ArtifactError, match="written by 2 host"):
        checkpoint_sync.download_latest(remote, tmp_path / "one")
    with pytest.raises(ArtifactError, match="this run has 4"):
        checkpoint_sync.download_latest(remote, tmp_path / "four", host=0, hosts=4)
    assert not (tmp_path / "one").exists() and not (tmp_path / "four").exists()


def _poll_all(syncers: list[checkpoint_sync.HostSyncer]) -> None:
    """Every host polls once, at the same point (the collective waits for all), as lora_sft's hosts do."""
    threads = [_in_thread(s.poll) for s in syncers]
    for thread, _ in threads:
        thread.join(HANG_GUARD)
    assert not any(thread.is_alive() for thread, _ in threads), "a host is still polling"
    errors = [e for _, errs in threads for e in errs]
    assert not errors, errors


@pytest.mark.parametrize("ahead", [0, 1])
def test_hosts_that_uploaded_different_steps_commit_the_newest_step_all_of_them_uploaded(
    gcs_bucket: str, tmp_path: Path, ahead: int
) -> None:
    """One host is a checkpoint ahead of the other (its Orbax finalised step 4, the other's has not yet):
    host 0 commits step 2, the newest step every host uploaded, and step 4 only once both uploaded it.
    (The other hosts' polls in the first test all see the same step.)"""
    remote = f"{gcs_bucket}/ck"
    collective = Collective(HOSTS)
    local = [tmp_path / f"host{i}" for i in range(HOSTS)]
    syncers = [checkpoint_sync.HostSyncer(local[i], remote, i, HOSTS, collective.of(i), keep=2) for i in range(HOSTS)]
    for host in range(HOSTS):
        _finalised_step(local[host], 2, host)
    _finalised_step(local[ahead], 4, ahead)

    _poll_all(syncers)
    assert checkpoint_sync.remote_steps(remote) == [2]
    assert artifacts.read_json(f"{remote}/4/host-{ahead}/{checkpoint_sync.HOST_MARKER}") is not None
    assert [s.committed for s in syncers] == [2, 2]

    _finalised_step(local[1 - ahead], 4, 1 - ahead)
    _poll_all(syncers)
    assert checkpoint_sync.remote_steps(remote) == [2, 4]
    assert set(artifacts.read_json(f"{remote}/4/{checkpoint_sync.MARKER}")["files"]) == {
        f"host-{h}/model_params/{name}" for h in range(HOSTS) for name in ("_METADATA", f"ocdbt.process_{h}/d")
    }


def test_a_run_of_several_hosts_keeps_the_two_newest_committed_steps(gcs_bucket: str, tmp_path: Path) -> None:
    """HostSyncer's default: the newest committed step and the one before it (a resume falls back to that
    one should the newest prove unreadable); older steps go, parts and commit markers alike."""
    remote = f"{gcs_bucket}/ck"
    collective = Collective(HOSTS)
    local = [tmp_path / f"host{i}" for i in range(HOSTS)]
    syncers = [checkpoint_sync.HostSyncer(local[i], remote, i, HOSTS, collective.of(i)) for i in range(HOSTS)]
    for step in (2, 4, 6):
        for host in range(HOSTS):
            _finalised_step(local[host], step, host)
        _poll_all(syncers)
    assert checkpoint_sync.remote_steps(remote) == [4, 6]
    assert sorted({b.name.split("/ck/", 1)[1].split("/")[0] for b in _blobs(remote)}) == ["4", "6"]


def _blobs(remote: str) -> list:
    from loraflow.storage import gcs

    bucket, path = gcs.split_uri(remote)
    return list(gcs.client().list_blobs(bucket, prefix=path + "/"))


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_prune_keeps_the_two_newest_complete_steps_and_nothing_else_goes(
    where: str, gcs_bucket: str, tmp_path: Path
) -> None:
    """One host (``Syncer`` and ``prune`` by default): steps 1-3 complete, step 4 uploaded without its
    marker (interrupted): 2 and 3 stay, 1 goes, the incomplete 4 is not touched."""
    remote = f"{gcs_bucket}/ck" if where == "gcs" else str(tmp_path / "remote")
    local = tmp_path / "local"
    syncer = checkpoint_sync.Syncer(local, remote)
    for step in (1, 2, 3):
        _finalised_step(local, step, 0)
        assert syncer.poll() == [step]
    assert checkpoint_sync.remote_steps(remote) == [2, 3]
    _finalised_step(local, 4, 0)
    if where == "gcs":
        artifacts.upload_tree(local / "4", f"{remote}/4")  # its files, no marker
    else:
        shutil.copytree(local / "4", Path(remote) / "4")
    checkpoint_sync.prune(remote)
    assert checkpoint_sync.remote_steps(remote) == [2, 3]
    if where == "gcs":
        left = {b.name.split("/ck/", 1)[1].split("/")[0] for b in _blobs(remote)}
    else:
        left = {p.name for p in Path(remote).iterdir()}
    assert left == {"2", "3", "4"}
    checkpoint_sync.prune(remote, keep=1)
    assert checkpoint_sync.remote_steps(remote) == [3]
