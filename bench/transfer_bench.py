"""3. Artifact transfer on the GCS emulator (in memory): a sharded checkpoint (~500 MiB) through
loraflow.storage.artifacts (upload_tree + commit; read_manifest + fetch, crc32c verified) against the plain
google-cloud-storage client one file after another (its defaults, checksum="auto"; and with
checksum=None, no verification at all), interleaved. Plus the time crc32c over the same files
takes. Run with the control env's Python.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK, WORK, median, save, say

from loraflow.dev import local_gcs
from loraflow.storage import artifacts, gcs

SHARDS, SHARD_MIB = (4, 16) if QUICK else (4, 128)


def make_tree(root: Path) -> int:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(SHARDS):
        with open(root / f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors", "wb") as f:
            for _ in range(SHARD_MIB):
                f.write(os.urandom(1 << 20))
    (root / "config.json").write_text('{"model_type": "llama"}')
    return sum(p.stat().st_size for p in root.iterdir())


def plain_upload(src: Path, prefix: str, checksum: str | None) -> None:
    bucket_name, base = gcs.split_uri(prefix)
    bucket = gcs.client().bucket(bucket_name)
    for p in sorted(src.iterdir()):
        bucket.blob(f"{base}/{p.name}").upload_from_filename(str(p), checksum=checksum)


def plain_download(prefix: str, dest: Path, checksum: str | None) -> None:
    bucket_name, base = gcs.split_uri(prefix)
    dest.mkdir(parents=True, exist_ok=True)
    for b in gcs.client().list_blobs(bucket_name, prefix=base + "/"):
        b.download_to_filename(str(dest / b.name[len(base) + 1 :]), checksum=checksum)


def delete_prefix(prefix: str) -> None:
    bucket_name, base = gcs.split_uri(prefix)
    for b in gcs.client().list_blobs(bucket_name, prefix=base + "/"):
        b.delete()


def main() -> None:
    root = WORK / "transfer"
    shutil.rmtree(root, ignore_errors=True)
    src = root / "src"
    nbytes = make_tree(src)
    emu = local_gcs.start("bench-transfer", log=root / "emulator.log")
    os.environ.update(emu.env())
    gcs.client.cache_clear()
    say(f"transfer: {nbytes / 2**20:.0f} MiB in {SHARDS + 1} files; emulator {emu.host}")
    methods = ["loraflow.pipeline.artifacts (crc32c verified)", "plain client, defaults", "plain client, checksum=None"]
    raw: dict[str, dict[str, list[float]]] = {m: {"upload_s": [], "download_s": []} for m in methods}
    crc_s: list[float] = []
    reps = 1 if QUICK else 3
    try:
        warm = root / "warm"
        warm.mkdir()
        (warm / "x.bin").write_bytes(os.urandom(1 << 20))
        artifacts.upload_tree(warm, "gs://bench-transfer/warm")  # client, connection pool, first-request costs
        plain_download("gs://bench-transfer/warm", root / "warm-down", None)
        delete_prefix("gs://bench-transfer/warm")
        for rep in range(reps):
            for i, m in enumerate(methods):
                prefix = f"gs://bench-transfer/r{rep}/m{i}"
                dest = root / f"dest-{i}"
                shutil.rmtree(dest, ignore_errors=True)
                t = time.perf_counter()
                if i == 0:
                    files = artifacts.upload_tree(src, prefix)
                    artifacts.commit(
                        prefix, files, stage="bench", inputs={}, config={}, lock_version="x", cache_key="x", summary={}
                    )
                else:
                    plain_upload(src, prefix, "auto" if i == 1 else None)
                up = time.perf_counter() - t
                t = time.perf_counter()
                if i == 0:
                    artifacts.fetch(artifacts.read_manifest(prefix), dest)
                else:
                    plain_download(prefix, dest, "auto" if i == 1 else None)
                down = time.perf_counter() - t
                assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in src.iterdir()), m
                raw[m]["upload_s"].append(up)
                raw[m]["download_s"].append(down)
                say(f"transfer rep {rep + 1}/{reps} {m}: up {up:.2f}s, down {down:.2f}s")
                delete_prefix(prefix)
                shutil.rmtree(dest, ignore_errors=True)
            t = time.perf_counter()
            for p in sorted(src.iterdir()):
                artifacts.crc32c_file(p)
            crc_s.append(time.perf_counter() - t)
    finally:
        emu.stop()
    import google.cloud.storage
    import google_crc32c

    summary = {m: {k: median(v) for k, v in d.items()} for m, d in raw.items()}
    for d in summary.values():
        d["upload_mib_s"] = nbytes / 2**20 / d["upload_s"]
        d["download_mib_s"] = nbytes / 2**20 / d["download_s"]
    save(
        "transfer",
        {
            "bytes": nbytes,
            "files": SHARDS + 1,
            "reps": reps,
            "summary": summary,
            "crc32c_all_files_s": median(crc_s),
            "crc32c_mib_s": nbytes / 2**20 / median(crc_s),
            "crc32c_implementation": google_crc32c.implementation,
            "google_cloud_storage": google.cloud.storage.__version__,
            "emulator": "fake-gcs-server, a Go HTTP server",
            "raw": raw,
        },
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
