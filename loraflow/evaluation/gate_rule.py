"""The promotion rule: is the tuned model better than the base model on the same examples?

Pure and deterministic (numpy only): the gate step reads the two evaluations and calls ``decide``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from loraflow.errors import LoraflowError


class GateError(LoraflowError):
    """The two evaluations cannot be compared (different examples, nothing to compare)."""


@dataclass(frozen=True)
class Decision:
    promote: bool
    metric: str
    n: int
    base: float
    tuned: float
    delta: float
    ci: tuple[float, float]
    confidence: float
    min_improvement: float
    fixed: int  # base wrong, tuned right
    broken: int  # base right, tuned wrong
    bootstrap_samples: int
    seed: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ci"] = list(self.ci)
        return out


def decide(
    base: Mapping[str, bool],
    tuned: Mapping[str, bool],
    *,
    metric: str = "accuracy",
    min_improvement: float = 0.3,
    confidence: float = 0.95,
    bootstrap_samples: int = 2000,
    seed: int = 0,
) -> Decision:
    """Paired comparison of two per-example outcomes on the same example ids.

    Args:
        base, tuned: example id -> outcome (True = the metric counts it, e.g. answered correctly).
            Both must hold exactly the same ids; anything else is refused with GateError, since an
            unpaired comparison would measure the sample, not the model.
        metric: name of the metric, recorded in the decision.
        min_improvement: the smallest gain in the metric (tuned - base, absolute) worth promoting.
        confidence: level of the two-sided percentile confidence interval of the gain.
        bootstrap_samples, seed: the paired bootstrap (examples resampled with replacement, the
            same resample for both models); fixed seed, so a decision is reproducible.

    Returns:
        A Decision with both scores, their difference ``delta``, its bootstrap interval ``ci``,
        the counts of fixed (base wrong -> tuned right) and broken (right -> wrong) examples.

    Rule: promote iff ``delta >= min_improvement`` **and** the interval's lower bound is
    ``> 0``: the gain must be large enough to matter and the tuned model must be better beyond
    resampling noise. (A stricter rule, lower bound ``>= min_improvement``, needs far more eval
    examples for the same gain; it is a one-line change here if wanted.)
    """
    import numpy as np

    if not 0.0 < confidence < 1.0:
        raise GateError(f"confidence must lie strictly between 0 and 1 (got {confidence})")
    if bootstrap_samples < 1:
        raise GateError(f"bootstrap_samples must be at least 1 (got {bootstrap_samples})")
    only_base = sorted(set(base) - set(tuned))
    only_tuned = sorted(set(tuned) - set(base))
    if only_base or only_tuned:
        raise GateError(
            f"the two evaluations cover different examples: {len(only_base)} id(s) only in base "
            f"(e.g. {only_base[:3]}), {len(only_tuned)} only in tuned (e.g. {only_tuned[:3]}); "
            "evaluate both models on the same eval set"
        )
    if not base:
        raise GateError("the evaluations hold no examples; nothing to compare")

    ids = sorted(base)
    b = np.array([bool(base[i]) for i in ids], dtype=np.float64)
    t = np.array([bool(tuned[i]) for i in ids], dtype=np.float64)
    n = len(ids)
    diff = t - b
    delta = float(diff.mean())

    rng = np.random.default_rng(seed)
    deltas = np.empty(bootstrap_samples)
    chunk = max(1, (1 << 22) // n)  # keep each (chunk, n) index block to a few MB
    for start in range(0, bootstrap_samples, chunk):
        stop = min(bootstrap_samples, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        deltas[start:stop] = diff[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = (float(x) for x in np.quantile(deltas, [alpha, 1.0 - alpha]))

    fixed = int(((b == 0) & (t == 1)).sum())
    broken = int(((b == 1) & (t == 0)).sum())
    pct = f"{confidence:.0%}"
    if delta < min_improvement:
        reason = (
            f"{metric} rose by {delta:+.3f} ({b.mean():.3f} -> {t.mean():.3f}), less than the required "
            f"{min_improvement:+.3f}; not promoted"
        )
        promote = False
    elif lo <= 0.0:
        reason = (
            f"{metric} rose by {delta:+.3f} but the {pct} interval [{lo:+.3f}, {hi:+.3f}] reaches 0: "
            f"the gain may be noise on {n} examples; not promoted (evaluate on more examples)"
        )
        promote = False
    else:
        reason = (
            f"{metric} rose by {delta:+.3f} ({b.mean():.3f} -> {t.mean():.3f}) >= {min_improvement:+.3f}, "
            f"{pct} interval [{lo:+.3f}, {hi:+.3f}] above 0; {fixed} examples fixed, {broken} broken"
        )
        promote = True
    return Decision(
        promote=promote,
        metric=metric,
        n=n,
        base=float(b.mean()),
        tuned=float(t.mean()),
        delta=delta,
        ci=(lo, hi),
        confidence=confidence,
        min_improvement=min_improvement,
        fixed=fixed,
        broken=broken,
        bootstrap_samples=bootstrap_samples,
        seed=seed,
        reason=reason,
    )
