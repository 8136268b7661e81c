"""What ``check.py --probe``'s samples say (``bench/tpu/probe/sitecustomize.py``): for each process, its full
garbage collections, JAX's timed events (traces, compiles) in the order they ended, the longest delays of the
sampler (the interpreter lock held, or the process stood), and where the main thread stood still longest, each
with the time since the process started.

    python bench/tpu/probe_report.py $OUT/probe [--top 12] [--min-s 0.2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a process that was killed mid-write
            continue
    return out


def report(path: Path, top: int, min_s: float) -> list[str]:
    lines = _lines(path)
    if not lines:
        return [f"== {path.name}: empty"]
    start = lines[0]["t"]
    head = lines[0].get("argv", [])
    runs = [r for r in lines if "main" in r]
    collections = [r for r in lines if "gc2" in r]
    out = [f"== {path.name} {' '.join(head)[:160]}: {len(runs)} runs of samples, {len(collections)} full collections"]
    if collections:
        longest = sorted(collections, key=lambda r: -r["gc2"])[:top]
        total = sum(r["gc2"] for r in collections)
        out.append(
            f"full collections: {total:.2f} s in all; longest "
            + ", ".join(f"{r['gc2']:.3f} s at +{r['t'] - start:.1f}" for r in longest)
        )
    events = [r for r in lines if "jax" in r]
    if events:
        out.append(f"JAX's timed events ({len(events)}, in the order they ended):")
        out.extend(f"  {r['s']:.3f} s ending at +{r['t'] - start:.1f}: {r['jax']}" for r in events[: top * 4])
    out.append("sampler delays (the interpreter lock held, or the process stood):")
    for r in sorted(runs, key=lambda r: -r["late"])[:top]:
        out.append(f"  {r['late']:.3f} s at +{r['t'] - start:.1f}: {' <- '.join(r['main'][:4])}")
    out.append(f"where the main thread stood {min_s} s or more:")
    for r in [r for r in runs if r["s"] >= min_s][: top * 4]:
        others = "; ".join(f"{name}: {frames[0] if frames else '-'}" for name, frames in r["threads"].items())
        out.append(f"  +{r['t'] - start:.2f} for {r['s']:.2f} s: {' <- '.join(r['main'][:5])}")
        if others:
            out.append(f"      others: {others[:300]}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--min-s", type=float, default=0.2, help="show where the main thread stood this long or longer")
    args = p.parse_args(argv)
    for path in sorted(args.folder.glob("probe-*.jsonl")):
        print("\n".join(report(path, args.top, args.min_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
