"""The run report: one self-contained HTML page a person reads to see what a run did and why.

Pure and stdlib-only: ``render`` turns the run's collected evidence (a plain dict, see
``loraflow.steps.report``) into HTML with inline CSS and inline SVG plots; nothing is fetched
from the network when the page is opened. Where a browser opens an object of the artifact store:
``loraflow/reporting/urls.py``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from loraflow.evaluation.metrics import METRICS

SAMPLES_PER_KIND = 5


# ------------------------------------------------------------------------------------ samples


def sample_outputs(
    base: Iterable[Mapping[str, Any]],
    tuned: Iterable[Mapping[str, Any]],
    per_kind: int = SAMPLES_PER_KIND,
    column: str = "correct",
) -> dict[str, list[dict[str, Any]]]:
    """Outputs before and after on the same examples: a few fixed, broken and unchanged ones.

    ``base`` and ``tuned`` are evaluate's prediction rows (id, prompt, reference, generation and the
    metric columns); ``column`` (the gated metric's, accuracy's ``correct`` by default) says which
    examples are right.
    """
    tuned_by_id = {str(r["id"]): r for r in tuned}
    out: dict[str, list[dict[str, Any]]] = {"fixed": [], "broken": [], "changed": [], "unchanged": []}
    for b in base:
        t = tuned_by_id.get(str(b["id"]))
        if t is None:
            continue
        bc, tc = bool(b.get(column)), bool(t.get(column))
        if not bc and tc:
            kind = "fixed"
        elif bc and not tc:
            kind = "broken"
        elif b.get("generation") != t.get("generation"):
            kind = "changed"
        else:
            kind = "unchanged"
        if len(out[kind]) < per_kind:
            out[kind].append(
                {
                    "id": str(b["id"]),
                    "prompt": b.get("prompt", ""),
                    "reference": b.get("reference", ""),
                    "base": b.get("generation", ""),
                    "base_correct": bc,
                    "tuned": t.get("generation", ""),
                    "tuned_correct": tc,
                }
            )
    return out


# ------------------------------------------------------------------------------------ SVG plots


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(x: float, exponent: int = 0) -> str:
    """A tick label; ``exponent``: the axis is drawn in units of 10**exponent."""
    if exponent and x:
        return f"{x:.4g}e{exponent}"
    return f"{x:.4g}"


def _finite_points(rows: Sequence[Sequence[Any]]) -> list[tuple[float, float]]:
    """The (step, loss) of each row whose both are finite numbers; any other row is left out."""
    points = []
    for row in rows:
        try:
            x, y = float(row[0]), float(row[1])
        except (TypeError, ValueError, IndexError):
            continue
        if math.isfinite(x) and math.isfinite(y):
            points.append((x, y))
    return points


def _unit_exponent(values: Sequence[float]) -> int:
    """``k`` such that ``values / 10**k`` lie within +-10: differences and padding near the ends of the
    float range (1e308 - -1e308) overflow; 0 for values that cannot."""
    largest = max(abs(v) for v in values)
    return math.floor(math.log10(largest)) if largest > 1e15 else 0


def loss_svg(rows: Sequence[Sequence[Any]], width: int = 640, height: int = 260) -> str:
    """The training loss curve (``rows`` of (step, loss[, ...])) as a standalone SVG document.

    Rows without a finite step and loss are left out; values beyond 1e15 are drawn in units of a
    power of ten (so that no difference overflows), the ticks labelled with it."""
    points = _finite_points(rows)
    esc = html.escape
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="training loss by step" class="plot">'
    )
    if not points:
        return head + f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no loss recorded</text></svg>'
    if len(points) > 1500:  # keep the page light: every k-th point, and the last
        k = math.ceil(len(points) / 1500)
        points = points[::k] + ([points[-1]] if (len(points) - 1) % k else [])
    left, right, top, bottom = 56, 16, 14, 40
    kx, ky = _unit_exponent([p[0] for p in points]), _unit_exponent([p[1] for p in points])
    xs, ys = [p[0] / 10.0**kx for p in points], [p[1] / 10.0**ky for p in points]
    points = list(zip(xs, ys, strict=True))
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.05 or abs(y1) * 0.05 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    parts = [head, f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#ccc"/>']
    for t in _ticks(y0, y1):
        parts.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
            f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" font-size="11">{esc(_fmt(t, ky))}</text>'
        )
    for t in _ticks(x0, x1):
        parts.append(
            f'<text x="{sx(t):.1f}" y="{top + ph + 16}" text-anchor="middle" font-size="11">{esc(_fmt(t, kx))}</text>'
        )
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    parts.append(f'<polyline fill="none" stroke="#1a73e8" stroke-width="1.5" points="{line}"/>')
    parts.append(
        f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" font-size="12">step</text>'
        f'<text x="14" y="{top + ph / 2}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 14 {top + ph / 2})">loss</text></svg>'
    )
    return "".join(parts)


def interval_svg(delta: float, ci: Sequence[float], required: float | None, width: int = 640, height: int = 70) -> str:
    """The gain with its confidence interval against 0 and the required improvement (None: not recorded, not drawn)."""
    lo, hi = float(ci[0]), float(ci[1])
    marks = [0.0, lo, hi, delta] if required is None else [0.0, lo, hi, delta, required]
    a = min(marks) - 0.05
    b = max(marks) + 0.05
    left, right = 20, 20

    def sx(x: float) -> float:
        return left + (x - a) / (b - a) * (width - left - right)

    y = 30
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="gain and its confidence interval" class="plot">'
        f'<line x1="{sx(0):.1f}" x2="{sx(0):.1f}" y1="8" y2="{height - 18}" stroke="#999"/>'
        f'<text x="{sx(0):.1f}" y="{height - 4}" text-anchor="middle" font-size="11">0</text>'
        f"{_required_mark(required, sx, height)}"
        f'<line x1="{sx(lo):.1f}" x2="{sx(hi):.1f}" y1="{y}" y2="{y}" stroke="#1a73e8" stroke-width="3"/>'
        f'<line x1="{sx(lo):.1f}" x2="{sx(lo):.1f}" y1="{y - 7}" y2="{y + 7}" stroke="#1a73e8" stroke-width="2"/>'
        f'<line x1="{sx(hi):.1f}" x2="{sx(hi):.1f}" y1="{y - 7}" y2="{y + 7}" stroke="#1a73e8" stroke-width="2"/>'
        f'<circle cx="{sx(delta):.1f}" cy="{y}" r="5" fill="#1a73e8"/>'
        f'<text x="{sx(delta):.1f}" y="{y - 11}" text-anchor="middle" font-size="11">{delta:+.3f} '
        f"[{lo:+.3f}, {hi:+.3f}]</text></svg>"
    )


# ------------------------------------------------------------------------------------ HTML

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1100px;
color:#202124;padding:0 1rem;line-height:1.45}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{font-size:1.2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem;
margin-top:2rem}
table{border-collapse:collapse;margin:.5rem 0;font-size:.9rem}th,td{border:1px solid #ddd;padding:.25rem .5rem;
text-align:left;vertical-align:top}th{background:#f4f6f8}td.num{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;padding:.15rem .6rem;border-radius:1rem;font-weight:600;color:#fff}
.yes{background:#188038}.no{background:#b3261e}.muted{color:#5f6368}.ok{color:#188038}.bad{color:#b3261e}
.warn{color:#b06000}
code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85rem}pre{white-space:pre-wrap;margin:0}
.plot{max-width:100%;height:auto}ul.notes li{margin:.2rem 0}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _required_mark(required: float | None, sx: Callable[[float], float], height: int) -> str:
    """The dashed line at the required improvement, labelled."""
    if required is None:
        return ""
    return (
        f'<line x1="{sx(required):.1f}" x2="{sx(required):.1f}" y1="8" y2="{height - 18}" '
        f'stroke="#e37400" stroke-dasharray="4 3"/>'
        f'<text x="{sx(required):.1f}" y="{height - 4}" text-anchor="middle" font-size="11" fill="#e37400">'
        f"required {required:+.3f}</text>"
    )


def _recorded_number(record: Mapping[str, Any], key: str) -> float | None:
    """``record[key]`` when it is a number; None when the record does not hold one (nothing is shown for it)."""
    value = record.get(key)
    return None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)


def _level(record: Mapping[str, Any]) -> str:
    """ "95% " for a decision or guard check whose interval is a 95% one, as recorded; nothing when not recorded."""
    confidence = _recorded_number(record, "confidence")
    return "" if confidence is None else f"{confidence:.0%} "


def _num(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or value is None:
        return _e(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return _e(value)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """``rows`` hold HTML already escaped by the caller."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _section(key: str, title: str, body: str) -> str:
    return f'<section id="{key}"><h2>{_e(title)}</h2>{body}</section>'


def _failure(failure: Mapping[str, Any]) -> str:
    out = (
        f'<p><span class="badge no">RUN FAILED</span> at <code>{_e(failure.get("stage"))}</code> &mdash; '
        f"{_e(failure.get('reason'))}</p>"
    )
    problems = failure.get("problems") or []
    if problems:
        out += "<ul class='notes'>" + "".join(f"<li class='bad'>{_e(p)}</li>" for p in problems) + "</ul>"
    if failure.get("stage") == "validate_data":
        out += (
            "<p>Nothing was converted or trained. Fix the data (or the rule's thresholds or level under "
            "<code>data.expectations</code> in the spec) and run again.</p>"
        )
    return out


def _verdict(
    decision: Mapping[str, Any] | None, publish: Mapping[str, Any] | None, failure: Mapping[str, Any] | None = None
) -> str:
    if failure:
        return _failure(failure)
    if not decision:
        return '<p><span class="badge no">no decision</span> the gate did not run</p>'
    promoted = bool(decision.get("promote"))
    badge = '<span class="badge yes">PROMOTED</span>' if promoted else '<span class="badge no">NOT PROMOTED</span>'
    version = ""
    if publish and publish.get("promoted"):
        version = f" as version {_e(publish.get('version'))}" + (
            f" (alias <code>{_e(publish.get('alias'))}</code>)" if publish.get("alias") else ""
        )
    return f"<p>{badge}{version} &mdash; {_e(decision.get('reason'))}</p>"


def _mismatch_line(data: Mapping[str, Any]) -> str:
    mismatch = template_mismatch(data)
    return f"<p class='bad'><b>CHAT TEMPLATE MISMATCH</b>: {_e(mismatch)}.</p>" if mismatch else ""


def _metrics_section(data: Mapping[str, Any]) -> str:
    base, tuned = data.get("base_metrics") or {}, data.get("tuned_metrics") or {}
    decision = data.get("decision") or {}
    if not base and not tuned:
        return '<p class="muted">no evaluation ran</p>'
    keys = [k for k in (*METRICS, "n") if k in base or k in tuned]
    rows = []
    for k in keys:
        b, t = base.get(k), tuned.get(k)
        delta = ""
        if isinstance(b, (int, float)) and isinstance(t, (int, float)) and k != "n":
            delta = f"{t - b:+.3f}"
        rows.append([_e(k), f'<span class="num">{_num(b)}</span>', f'<span class="num">{_num(t)}</span>', delta])
    out = _table(["metric", "before (base)", "after (tuned)", "change"], rows)
    if decision.get("ci"):
        lo, hi = decision["ci"]
        out += (
            f"<p>Paired comparison on the same {_e(decision.get('n'))} examples ({_e(decision.get('metric'))}): "
            f"gain <b>{float(decision.get('delta', 0)):+.3f}</b>, {_level(decision)}"
            f"bootstrap interval <b>[{float(lo):+.3f}, {float(hi):+.3f}]</b> "
            f"({_e(decision.get('bootstrap_samples'))} resamples); "
            f"{_e(decision.get('fixed'))} examples fixed, {_e(decision.get('broken'))} broken.</p>"
        )
        required = _recorded_number(decision, "min_improvement")
        out += interval_svg(float(decision.get("delta", 0)), (lo, hi), required)
    out += _suites_table(base, tuned) + _guard_paragraph(base, tuned, decision.get("guard"))
    return out + _merge_cost_table(data.get("merge_cost"))


def _suites_table(base: Mapping[str, Any], tuned: Mapping[str, Any]) -> str:
    """The standard benchmarks (evaluation.suites): each suite's figure before and after."""
    b, t = base.get("suites") or {}, tuned.get("suites") or {}
    rows = []
    for name in dict.fromkeys([*b, *t]):
        before, after = b.get(name) or {}, t.get(name) or {}
        named = before or after
        vb, vt = before.get("value"), after.get("value")
        change = f"{vt - vb:+.3f}" if isinstance(vb, (int, float)) and isinstance(vt, (int, float)) else ""
        rows.append(
            [
                _e(name),
                f"<code>{_e(named.get('task'))}</code> {_e(named.get('metric'))}",
                _e(named.get("n")),
                f'<span class="num">{_num(vb)}</span>',
                f'<span class="num">{_num(vt)}</span>',
                change,
            ]
        )
    if not rows:
        return ""
    return (
        "<h3>Standard benchmarks</h3><p>lm-evaluation-harness tasks, scored by the evaluation's own engine with "
        "the eval set's chat template.</p>"
        + _table(["suite", "task and metric", "documents", "before (base)", "after (tuned)", "change"], rows)
    )


def _guard_paragraph(base: Mapping[str, Any], tuned: Mapping[str, Any], check: Mapping[str, Any] | None) -> str:
    """The regression guard (gate.guard): the set, both accuracies, the paired evidence and the verdict."""
    b, t = base.get("guard") or {}, tuned.get("guard") or {}
    if not (b or t or check):
        return ""
    if not (b or t):  # a guard on a suite (gate.guard.suite): its figures are in the benchmarks' table
        out = f"<h3>Regression guard</h3><p>On {_e((check or {}).get('set'))}.</p>"
        return out + _guard_verdict(check)
    named = b or t
    out = (
        f"<h3>Regression guard</h3><p>Set <code>{_e(named.get('set'))}</code> (sha256 "
        f"<code>{_e(str(named.get('sha256', ''))[:12])}</code>, {_e(named.get('n'))} questions, each option scored by "
        f"its log-likelihood): accuracy <b>{_num(b.get('accuracy'))}</b> before, <b>{_num(t.get('accuracy'))}</b> "
        "after.</p>"
    )
    return out + _guard_verdict(check)


def _guard_verdict(check: Mapping[str, Any] | None) -> str:
    """The guard's verdict with its paired evidence and interval."""
    if not check:
        return '<p class="muted">the gate did not check it</p>'
    lo, hi = check.get("ci") or (0.0, 0.0)
    verdict = "passed" if check.get("passed") else "FAILED"
    out = (
        f"<p class='{'ok' if check.get('passed') else 'bad'}'><b>{verdict}</b> (rule {_e(check.get('rule'))}, at most "
        f"{_num(_recorded_number(check, 'max_drop'))} lost): change <b>{float(check.get('delta', 0)):+.3f}</b>, "
        f"{_level(check)}interval [{float(lo):+.3f}, {float(hi):+.3f}]; "
        f"{_e(check.get('broken'))} questions broken, {_e(check.get('fixed'))} fixed.</p>"
    )
    max_drop = _recorded_number(check, "max_drop")
    return out + interval_svg(float(check.get("delta", 0)), (lo, hi), None if max_drop is None else -max_drop)


def _merge_cost_table(cost: Mapping[str, Any] | None) -> str:
    """QLoRA: the model as it trained (quantized base + adapter) against the merged one it became."""
    if not cost:
        return ""
    rows = [
        [
            _e(r["metric"]),
            f'<span class="num">{_num(r["quantized"])}</span>',
            f'<span class="num">{_num(r["merged"])}</span>',
            f"{float(r['change']):+.3f}",
        ]
        for r in cost.get("metrics", [])
    ]
    return (
        f"<h3>What merging cost (QLoRA)</h3><p>The first {_e(cost.get('n'))} eval examples, answered by the model "
        "as it trained (the quantized base + adapter, greedy, in lora_sft) and by the merged model that was "
        f"evaluated and published (the full-precision base + adapter, vLLM); {_e(cost.get('identical_outputs'))} "
        "answers identical.</p>"
        + _table(["metric", "trained (quantized + adapter)", "merged (published)", "change"], rows)
    )


def _gate_section(data: Mapping[str, Any]) -> str:
    decision = data.get("decision")
    if not decision:
        return '<p class="muted">the gate did not run</p>'
    rows = [
        ["promote", _e(decision.get("promote"))],
        ["reason", _e(decision.get("reason"))],
        ["rule", _e(decision.get("rule"))],
        ["metric", _e(decision.get("metric"))],
        ["required improvement", _num(decision.get("min_improvement"))],
        ["identical generations", _e(decision.get("identical_generations"))],
        *_guard_row(decision),
        *_champion_row(decision),
    ]
    out = _table(["", ""], rows)
    notes = decision.get("notes") or []
    if notes:
        out += "<p>Notes:</p><ul class='notes'>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"
    return out + _publish_outcome(data.get("publish"), decision)


def _guard_row(decision: Mapping[str, Any]) -> list[list[str]]:
    check = decision.get("guard")
    if not check:
        return []
    return [
        ["regression guard", ("passed" if check.get("passed") else "FAILED") + f" &mdash; {_e(check.get('reason'))}"]
    ]


def _champion_row(decision: Mapping[str, Any]) -> list[list[str]]:
    """The registry's champion the tuned model was compared with (none: the first model)."""
    champion = decision.get("champion")
    if champion:
        text = _e(
            f"version {champion.get('version')} (run {champion.get('run_id')}): "
            f"{champion.get('metric')} {champion.get('value')}"
        )
        return [["champion", text + (f" &mdash; {_e(champion.get('verdict'))}" if champion.get("verdict") else "")]]
    if "champion" in decision:
        return [["champion", "none yet: the first model of this pipeline is compared with the base only"]]
    return []


def _publish_outcome(publish: Mapping[str, Any] | None, decision: Mapping[str, Any]) -> str:
    """Where the model was published (the registry version, the Vertex AI mirror), or why not."""
    if not publish:
        return "<p>Not published (the gate did not promote).</p>" if decision.get("promote") is False else ""
    if not publish.get("promoted"):
        return f"<p>Not published: {_e(publish.get('reason'))}</p>"
    out = f"<p>Published as version <b>{_e(publish.get('version'))}</b>: <code>{_e(publish.get('version_uri'))}</code></p>"
    vertex = publish.get("vertex_model_registry")
    if vertex:
        aliases = ", ".join(vertex.get("version_aliases") or []) or "none"
        out += (
            f"<p>Vertex AI Model Registry: <code>{_e(vertex.get('model'))}@{_e(vertex.get('version_id'))}</code>"
            f" (aliases: {_e(aliases)})</p>"
        )
    return out


def _training_section(data: Mapping[str, Any]) -> str:
    loss = data.get("loss") or []
    summary = data.get("training_summary") or {}
    facts = ", ".join(
        f"{k} {_num(summary[k])}"
        for k in ("steps", "first_loss", "final_loss", "tokens_per_s", "lora_b_norm")
        if k in summary
    )
    if "train_state_bytes" in summary:
        facts += (
            f"; {_e(summary.get('quantization') or 'none')} base weights, training state "
            f"{summary['train_state_bytes'] / 2**20:.1f} MiB (adapter {summary['adapter_bytes'] / 2**20:.2f} MiB, "
            f"optimizer {summary['optimizer_bytes'] / 2**20:.2f} MiB)"
        )
    if "step_temp_bytes" in summary:
        facts += (
            f"; compiled train step per device: arguments {summary['step_argument_bytes'] / 2**20:.1f} MiB, "
            f"temporaries {summary['step_temp_bytes'] / 2**20:.1f} MiB"
        )
    if "tuning_remat_policy" in summary:
        facts += f"; training.tuning: auto trained with remat_policy {_e(summary['tuning_remat_policy'])}"
    body = f"<p>{facts}</p>" if facts else ""
    return body + (loss_svg(loss) if loss else '<p class="muted">no loss curve (training did not run)</p>')


# Where each stage records the chat template that rendered its prompts (loraflow/data/chat_template.py).
TEMPLATE_SOURCES = (
    ("validate_data", "data_report", "resolved and checked on every row"),
    ("lora_sft", "training_summary", "rendered the training examples"),
    ("evaluate_base", "base_metrics", "rendered the base model's eval prompts"),
    ("evaluate_tuned", "tuned_metrics", "rendered the tuned model's eval prompts"),
)


def chat_templates(data: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """stage -> the chat template it recorded (setting, origin, sha256), for the stages that recorded one."""
    found = {}
    for stage, key, _ in TEMPLATE_SOURCES:
        recorded = (data.get(key) or {}).get("chat_template")
        if isinstance(recorded, Mapping) and recorded.get("sha256"):
            found[stage] = recorded
    return found


def template_mismatch(data: Mapping[str, Any]) -> str | None:
    """The warning when the stages rendered prompts with different chat templates; None when they agree."""
    found = chat_templates(data)
    if len({str(t["sha256"]) for t in found.values()}) <= 1:
        return None
    named = ", ".join(f"{stage} {str(t['sha256'])[:12]}" for stage, t in found.items())
    return (
        f"the stages rendered prompts with different chat templates ({named}): the scores do not measure the "
        "model on the prompts it was trained on. Re-run the pipeline with data.chat_template set explicitly "
        "so that every stage renders with one template"
    )


def _templates_section(data: Mapping[str, Any]) -> str:
    found = chat_templates(data)
    if not found:
        return '<p class="muted">no stage recorded a chat template</p>'
    why = {stage: what for stage, _, what in TEMPLATE_SOURCES}
    rows = [
        [
            f"<code>{_e(stage)}</code>",
            _e(why[stage]),
            _e(t.get("setting")),
            _e(t.get("origin")),
            f"<code>{_e(str(t.get('sha256'))[:12])}</code>",
        ]
        for stage, t in found.items()
    ]
    out = _table(["stage", "what it rendered", "setting", "template", "sha256"], rows)
    mismatch = template_mismatch(data)
    if mismatch:
        return out + f"<p class='bad'><b>CHAT TEMPLATE MISMATCH</b>: {_e(mismatch)}.</p>"
    return out + f"<p class='ok'>All {len(found)} stage(s) rendered prompts with the same chat template.</p>"


def _data_section(data: Mapping[str, Any]) -> str:
    report = data.get("data_report")
    if not report:
        return '<p class="muted">no data report</p>'
    out = _data_statistics(report.get("statistics", {}))
    out += _expectations_summary(report)
    out += _expectations_table(report.get("expectations", []))
    for f in report.get("failures") or []:
        out += f"<p class='bad'>{_e(f)}</p>"
    for w in report.get("warnings") or []:
        out += f"<p class='warn'>warning: {_e(w)}</p>"
    if data.get("data_docs_url"):
        out += (
            f'<p>Great Expectations data docs: <a href="{_e(data["data_docs_url"])}">'
            f"<code>{_e(data.get('data_docs'))}</code></a></p>"
        )
    return out


def _data_statistics(stats: Mapping[str, Any]) -> str:
    """One row per split: its file, format, rows and token lengths."""
    rows = []
    for split in ("train", "eval"):
        s = stats.get(split)
        if isinstance(s, Mapping):
            tokens = f"{s.get('tokens_min')} / {s.get('tokens_mean')} / {s.get('tokens_max')}"
            rows.append(
                [
                    _e(split),
                    _e(s.get("file")),
                    _e(s.get("format")),
                    f'<span class="num">{_e(s.get("rows"))}</span>',
                    _e(tokens),
                ]
            )
    return _table(["split", "file", "format", "rows", "tokens min / mean / max"], rows)


def _expectations_summary(report: Mapping[str, Any]) -> str:
    """How many expectations passed and warned, and whether the data contract holds."""
    stats = report.get("statistics", {})
    warned = stats.get("warned_expectations") or 0
    verdict = (
        '<span class="ok">(data contract holds)</span>'
        if report.get("success")
        else '<span class="bad">(contract broken)</span>'
    )
    return (
        f"<p>Expectations: <b>{_e(stats.get('successful_expectations'))}</b> of "
        f"{_e(stats.get('evaluated_expectations'))} passed"
        + (f", <span class='warn'>{_e(warned)} warned</span>" if warned else "")
        + f" {verdict}</p>"
    )


def _expectations_table(expectations: list[Mapping[str, Any]]) -> str:
    """Every expectation of the data contract with what GX observed and its outcome."""
    rows = [
        [
            _e(x.get("dataset")),
            _e(x.get("rule")),
            _e(x.get("level")),
            _e(x.get("check")),
            f"<code>{_e(x.get('type'))}</code>",
            _e(x.get("observed")),
            _OUTCOME.get(str(x.get("outcome") or ("pass" if x.get("success") else "fail")), ""),
        ]
        for x in expectations
    ]
    return _table(["split", "rule", "level", "check", "expectation", "observed", "result"], rows)


_OUTCOME = {
    "pass": '<span class="ok">pass</span>',
    "warn": '<span class="warn">WARN</span>',
    "fail": '<span class="bad">FAIL</span>',
}


def _samples_section(data: Mapping[str, Any]) -> str:
    samples = data.get("samples") or {}
    if not any(samples.values()):
        return '<p class="muted">no predictions to compare</p>'
    titles = {
        "fixed": "fixed (wrong before, right after)",
        "broken": "broken (right before, wrong after)",
        "changed": "changed output, same outcome",
        "unchanged": "unchanged",
    }
    out = ""
    for kind, title in titles.items():
        rows = samples.get(kind) or []
        if not rows:
            continue

        def mark(ok: bool) -> str:
            return '<span class="ok">&#10003;</span>' if ok else '<span class="bad">&#10007;</span>'

        out += f"<h3>{_e(title)}</h3>" + _table(
            ["id", "prompt", "reference", "before", "after"],
            [
                [
                    _e(r["id"]),
                    f"<pre>{_e(r['prompt'])}</pre>",
                    f"<pre>{_e(r['reference'])}</pre>",
                    f"{mark(r['base_correct'])} <pre>{_e(r['base'])}</pre>",
                    f"{mark(r['tuned_correct'])} <pre>{_e(r['tuned'])}</pre>",
                ]
                for r in rows
            ],
        )
    return out


def _stages_section(data: Mapping[str, Any]) -> str:
    rows = []
    total = 0.0
    for s in data.get("stages") or []:
        seconds = s.get("seconds")
        status = s.get("status")
        if status == "ran" and isinstance(seconds, (int, float)):
            total += float(seconds)
        if status == "reused":
            shown = f'<span class="muted">0 (took {_num(seconds, 1)} in run {_e(s.get("from_run"))})</span>'
            status_html = '<span class="ok">cache hit</span>'
        elif status == "ran":
            shown = _num(seconds, 1)
            status_html = "ran"
        else:
            shown = ""
            status_html = f'<span class="muted">{_e(status)}</span>'
        rows.append(
            [
                _e(s.get("stage")),
                status_html,
                f'<span class="num">{shown}</span>',
                f"<code>{_e(s.get('manifest') or '')}</code>",
            ]
        )
    hits = sum(1 for s in data.get("stages") or [] if s.get("status") == "reused")
    return (
        _table(["stage", "this run", "seconds", "manifest"], rows)
        + f"<p>{hits} cache hit(s); {total:.1f} s of stage time spent in this run (step programs, as each manifest "
        "records it).</p>"
    )


def render(data: Mapping[str, Any]) -> str:
    """The report page for one run. ``data`` is what ``loraflow.steps.report`` collects."""
    title = f"{data.get('pipeline', 'pipeline')} · run {data.get('run_id', '?')}"
    sections = [
        _section(
            "verdict",
            "Verdict",
            _verdict(data.get("decision"), data.get("publish"), data.get("failure")) + _mismatch_line(data),
        ),
        _section("metrics", "Before vs after", _metrics_section(data)),
        _section("gate", "Gate decision", _gate_section(data)),
        _section("training", "Training loss", _training_section(data)),
        _section("data", "Dataset and expectations", _data_section(data)),
        _section("templates", "Chat template: training and evaluation", _templates_section(data)),
        _section("samples", "Sample outputs before and after", _samples_section(data)),
        _section("stages", "Stages: durations and cache hits", _stages_section(data)),
    ]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>{_e(title)}</h1><p class='muted'>loraflow run report, generated {_e(data.get('generated_at'))}; "
        f"artifacts under <code>{_e(data.get('run_prefix'))}</code></p>" + "".join(sections) + "</body></html>\n"
    )
