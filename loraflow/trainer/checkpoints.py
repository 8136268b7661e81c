"""Where lora_sft's checkpoints go, and how a restarted run finds the newest one (``checkpoint_storage``).

``staged`` (the default): Orbax/Tunix saves every ``checkpoint_period`` steps into a directory on the
host's own disk, and the newest committed step is downloaded before the trainer starts, so a restarted
run, on new hosts, resumes from it (Tunix restores the LoRA params, optimizer state and step; the
batches already trained on are skipped). One host: each finalised step is copied to
``{output}/_checkpoints/<step>/`` (outside the committed files), the completion marker last. Several
hosts: every host's Orbax is a primary of its own directory and writes the metadata and every shard
it holds, replicated ones included (:mod:`loraflow.trainer.per_host_checkpoints`), so that directory
alone restores that host; each host uploads its part to ``{output}/_checkpoints/<step>/host-<i>/``
(its ``_LORAFLOW_HOST.json`` last); at each training step the hosts agree (a collective) which step
all have uploaded, and process 0 commits it once (``<step>/_LORAFLOW_COMPLETE.json``, listing every
host's files); a resume downloads each host's own part of the newest committed step, and needs the
same number of hosts (``loraflow.storage.checkpoint_sync``).

``direct`` points MaxText's base_output_directory at that gs:// prefix instead: Orbax writes it itself
(tensorstore's GCS driver, every host its own shards, process 0 the metadata and ``commit_success.txt``
last) and restores the newest committed step from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraflow.errors import LoraflowError
from loraflow.launchers import multihost
from loraflow.storage import checkpoint_sync, gcs
from loraflow.trainer.argv import RUN_NAME
from loraflow.trainer.distributed import barrier, gather_ints
from loraflow.trainer.sft_run import Progress, SftRun


@dataclass(frozen=True)
class Checkpoints:
    """Where this run's checkpoints go."""

    base_output: str  # MaxText's base_output_directory: a local directory, or the gs:// prefix (direct)
    local_ckpt: Path  # where Orbax writes them, when local
    syncer: checkpoint_sync.Syncer | checkpoint_sync.HostSyncer | None  # staged: persists each to GCS
    per_host: bool  # staged on several hosts: every host's Orbax writes (and restores) its own shards locally


def checkpoint_storage(sft: SftRun, dist: multihost.DistributedConfig | None) -> Checkpoints:
    """Where Orbax writes checkpoints; staged ones are first fetched from GCS to resume (every host its own part)."""
    remote = sft.output_uri.rstrip("/") + "/_checkpoints"
    if sft.cfg.checkpoint_storage == "direct":
        gcs.route_native_clients()  # Orbax's own GCS clients: at the emulator when there is one
        sft.progress(f"checkpoints: Orbax writes them to {remote} (direct)")
        local_ckpt = Path(remote) / RUN_NAME / "checkpoints"  # never a directory: nothing local to copy
        if dist is not None:
            barrier("checkpoint directory ready")
        return Checkpoints(remote, local_ckpt, None, per_host=False)
    base_output = str(sft.work / "maxtext")  # this host's own disk
    local_ckpt = Path(base_output) / RUN_NAME / "checkpoints"
    if dist is None:
        return Checkpoints(base_output, local_ckpt, _staged_syncer(local_ckpt, remote, sft.progress), per_host=False)
    syncer = _host_syncer(dist, local_ckpt, remote, sft.progress)
    barrier("checkpoint directory ready")
    return Checkpoints(base_output, local_ckpt, syncer, per_host=True)


def _staged_syncer(local_ckpt: Path, remote: str, progress: Progress) -> checkpoint_sync.Syncer:
    """Download the newest complete checkpoint (a restarted run resumes from it); then persist each new one."""
    local_ckpt.mkdir(parents=True, exist_ok=True)
    restored = checkpoint_sync.download_latest(remote, local_ckpt)
    if restored is not None:
        progress(f"found checkpoint step {restored} under {remote}: resuming from it")
    return checkpoint_sync.Syncer(local_ckpt, remote, progress)


def _host_syncer(
    dist: multihost.DistributedConfig, local_ckpt: Path, remote: str, progress: Progress
) -> checkpoint_sync.HostSyncer:
    """This host's part of the newest committed checkpoint onto its own disk; then persist its part of each new one."""
    local_ckpt.mkdir(parents=True, exist_ok=True)
    host, hosts = dist.process_id, dist.num_processes
    progress(
        f"checkpoints: host {host} stages its own shards on its disk and uploads them to "
        f"{remote}/<step>/{checkpoint_sync.host_part(host)} (staged); host 0 commits each step every host uploaded"
    )
    restored = checkpoint_sync.download_latest(remote, local_ckpt, host=host, hosts=hosts)
    found = gather_ints(restored or 0)
    if len(set(found)) != 1:
        raise LoraflowError(f"the hosts found different newest checkpoints under {remote} (steps by host: {found})")
    if restored is not None:
        progress(f"found checkpoint step {restored} under {remote}: host {host} resumes from its part")
    return checkpoint_sync.HostSyncer(local_ckpt, remote, host, hosts, gather_ints, progress)
