"""`hivetune report RUN`: one self-contained HTML page (every image inlined as a base64 data
URI) and the PNG files, from what a run folder holds:

- ``metrics.jsonl``: training loss and validation loss (``val_loss`` records), learning rate,
  grad norm, tokens/s and peak memory over the steps;
- ``plan.json``: the planner's memory breakdown, when the run has one;
- ``eval/eval.json``: the A/B table of ``hivetune eval`` (base vs tuned);
- ``config.yaml`` and ``summary.json`` (with the environment the run recorded).

A section whose file is missing says so; the page is still written. Drawing needs matplotlib
(the ``plots`` extra); it is drawn on Agg canvases, never through pyplot's global state.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.core.versions import installed_version

REPORT_HTML = "report.html"
GIB = 2**30


# ---------------------------------------------------------------- reading the run folder


@dataclass
class RunRecords:
    steps: list[dict] = field(default_factory=list)  # per-step records (they have "loss")
    validation: list[dict] = field(default_factory=list)  # {"step", "val_loss", ...} records
    skipped_lines: int = 0  # an unfinished last line of a run still writing


def read_metrics(path: Path) -> RunRecords:
    """metrics.jsonl split into step records and validation records. A malformed line is an
    error naming file:line, except an unterminated last line (the run may be writing it)."""
    records = RunRecords()
    if not path.is_file():
        return records
    data = path.read_bytes()
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("expected an object with an integer 'step'")
        except ValueError as e:
            if number == len(lines) and not data.endswith(b"\n"):
                records.skipped_lines += 1
                continue
            raise UserError(f"{path}:{number}: bad metrics record ({e})") from None
        if "val_loss" in record:
            records.validation.append(record)
        elif "loss" in record:
            records.steps.append(record)
    return records


def read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a JSON object")
    return value


def plan_breakdown(plan: dict) -> list[tuple[str, float]] | None:
    """(component, bytes) pairs from plan.json: `hivetune plan --json`'s "parts_gib" ({name:
    GiB}), or a "breakdown" ({name: bytes} or a list of {"name", "bytes"}). None when neither
    holds a number."""
    pairs = []
    if isinstance(plan.get("parts_gib"), dict):
        pairs = [(name, v * GIB if _is_number(v) else None) for name, v in plan["parts_gib"].items()]
    else:
        table = plan.get("breakdown")
        if isinstance(table, dict):
            pairs = list(table.items())
        elif isinstance(table, list):
            pairs = [(item.get("name") or item.get("label"), item.get("bytes")) for item in table if isinstance(item, dict)]
    pairs = [(str(n), float(v)) for n, v in pairs if n and _is_number(v)]
    return pairs or None


def plan_peak_bytes(plan: dict) -> float | None:
    if _is_number(plan.get("peak_gib")):
        return plan["peak_gib"] * GIB
    return plan.get("peak_bytes") if _is_number(plan.get("peak_bytes")) else None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---------------------------------------------------------------- drawing


def require_matplotlib():
    """matplotlib's Figure and Agg canvas, or a UserError saying how to install it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("report: drawing needs matplotlib, which is not installed: "
                        "pip install 'hivetune[plots]' (or pip install matplotlib)") from None
    return Figure, FigureCanvasAgg


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _values(records: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """Steps and values of `key`; a missing or null value (a skipped step) is a gap (NaN)."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        steps.append(r["step"])
        values.append(v / scale if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan)
    return steps, values


def line_chart(title: str, ylabel: str, series: list[tuple[str, list[int], list[float], dict]]) -> bytes:
    """One chart over optimizer steps; each series is (label, steps, values, plot kwargs)."""
    Figure, Canvas = require_matplotlib()
    fig = Figure(figsize=(5.4, 3.2), layout="constrained")
    Canvas(fig)
    ax = fig.subplots()
    for label, xs, ys, style in series:
        ax.plot(xs, ys, label=label, **style)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return _png(fig)


def bar_chart(title: str, xlabel: str, labels: list[str], values: list[float]) -> bytes:
    """Horizontal bars, the first label on top, each bar with its value written beside it."""
    Figure, Canvas = require_matplotlib()
    fig = Figure(figsize=(7.5, 1.3 + 0.38 * len(labels)), layout="constrained")
    Canvas(fig)
    ax = fig.subplots()
    ax.barh(range(len(labels)), values, color="#4c72b0")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.3g}", va="center")
    ax.set_xlim(0, max(values + [1e-9]) * 1.18)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    return _png(fig)


def ab_chart(means: dict) -> bytes:
    """Base vs tuned: response loss on the left, the percentage scores on the right."""
    Figure, Canvas = require_matplotlib()
    fig = Figure(figsize=(7.5, 3.2), layout="constrained")
    Canvas(fig)
    loss_ax, pct_ax = fig.subplots(1, 2, width_ratios=[1, 3])
    colors = {"base": "#8c8c8c", "tuned": "#dd8452"}
    for i, side in enumerate(("base", "tuned")):
        loss = means[side].get("loss")
        loss_ax.bar(i, loss if loss is not None else 0, color=colors[side], label=side)
    loss_ax.set_xticks([0, 1], ["base", "tuned"])
    loss_ax.set_title("response loss\n(lower is better)")
    metrics = [("exact match", "exact_match"), ("token F1", "f1"), ("ROUGE-L", "rouge_l"),
               ("command hit", "command_hit")]
    for j, side in enumerate(("base", "tuned")):
        values = [100 * (means[side].get(k) or 0) for _, k in metrics]
        pct_ax.bar([i + 0.4 * j - 0.2 for i in range(len(metrics))], values, width=0.4, color=colors[side], label=side)
    pct_ax.set_xticks(range(len(metrics)), [m for m, _ in metrics])
    pct_ax.set_ylabel("%")
    pct_ax.set_title("answer scores (higher is better)")
    pct_ax.legend()
    return _png(fig)


def draw_charts(metrics: RunRecords, plan: dict | None, ev: dict | None) -> dict[str, bytes]:
    """File name -> PNG bytes, for every chart the data allows."""
    charts = {}
    if metrics.steps:
        s = metrics.steps
        loss = [("training loss", *_values(s, "loss"), {"color": "#4c72b0", "linewidth": 1.2})]
        if metrics.validation:
            loss.append(("validation loss", *_values(metrics.validation, "val_loss"),
                         {"color": "#c44e52", "marker": "o", "linewidth": 1.5}))
        charts["loss.png"] = line_chart("Loss", "mean loss per target token", loss)
        charts["lr.png"] = line_chart("Learning rate", "lr", [("lr", *_values(s, "lr"), {"color": "#55a868"})])
        charts["grad_norm.png"] = line_chart("Gradient norm (before clipping)", "global L2 norm",
                                             [("grad norm", *_values(s, "grad_norm"), {"color": "#8172b3"})])
        charts["tokens_per_s.png"] = line_chart("Throughput", "tokens / s",
                                                [("tokens/s", *_values(s, "tokens_per_s"), {"color": "#937860"})])
        charts["memory.png"] = line_chart("Peak memory", "GiB",
                                          [("peak memory", *_values(s, "peak_memory_bytes", GIB), {"color": "#da8bc3"})])
    elif metrics.validation:
        charts["loss.png"] = line_chart("Validation loss", "mean loss per target token",
                                        [("validation loss", *_values(metrics.validation, "val_loss"),
                                          {"color": "#c44e52", "marker": "o"})])
    breakdown = plan_breakdown(plan) if plan else None
    if breakdown:
        charts["plan_memory.png"] = bar_chart("Planned memory", "GiB", [n for n, _ in breakdown],
                                              [b / GIB for _, b in breakdown])
    if ev and isinstance(ev.get("means"), dict) and {"base", "tuned"} <= set(ev["means"]):
        charts["eval.png"] = ab_chart(ev["means"])
    return charts


# ---------------------------------------------------------------- the page


def environment(device: str = "") -> dict:
    """What produced a run: versions, platform, CPU / GPU and the hivetune commit when known."""
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__}
    for name in ("transformers", "peft", "numpy"):
        if (version := installed_version(name)) is not None:
            env[name] = version
    from hivetune import __version__
    env["hivetune"] = __version__
    commit = head_commit()
    if commit:
        env["commit"] = commit
    env["cpu"] = _cpu_name()
    env["cpu_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda or torch.version.hip or ""
    if device:
        env["device"] = device
    return env


def head_commit() -> str:
    """The short hash of the checkout this module runs from, or "" outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("model name")), "")
        return line.split(":", 1)[1].strip() if line else platform.processor()
    except OSError:
        return platform.processor()


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.charts img, img.wide { max-width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; margin: .6em 0; } td, th { border: 1px solid #ccc; padding: .3em .6em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; white-space: pre-wrap; font-size: .9em; }
.missing { color: #8a6d3b; background: #fcf8e3; padding: .5em .8em; border-radius: 4px; }
.better { color: #2e7d32; font-weight: 600; } .worse { color: #c62828; font-weight: 600; }
"""


def _img(name: str, png: bytes, alt: str) -> str:
    return (f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}" alt="{html.escape(alt)}" '
            f'data-file="{html.escape(name)}">')


def _table(header: list[str] | None, rows: list[list[str]], numeric_from: int = 1) -> str:
    """An HTML table (no header row when `header` is None); cells are already-escaped HTML."""
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i >= numeric_from else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _missing(text: str) -> str:
    return f'<p class="missing">{html.escape(text)}</p>'


def _num(value, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def summary_section(run: Path, summary: dict | None, metrics: RunRecords) -> str:
    rows = [["run folder", html.escape(str(run))]]
    if summary:
        for key, label in (("steps", "optimizer steps"), ("final_loss", "final training loss"),
                           ("train_seconds", "training time (s)"), ("tokens_per_s", "tokens / s"),
                           ("examples", "training examples"), ("device", "device"), ("precision", "precision"),
                           ("adapter", "adapter")):
            if summary.get(key) is not None:
                value = summary[key]
                text = f"{value:.4f}" if key == "final_loss" else f"{value:,.1f}" if isinstance(value, float) else str(value)
                rows.append([label, html.escape(text)])
        if summary.get("peak_memory_bytes"):
            rows.append(["peak memory", f"{summary['peak_memory_bytes'] / GIB:.2f} GiB"])
    elif metrics.steps:
        last = metrics.steps[-1]
        rows.append(["last logged step", str(last["step"])])
        rows.append(["summary", "no summary.json: the run has not finished (or was stopped)"])
    if metrics.validation:
        best = min((v for v in metrics.validation if isinstance(v.get("val_loss"), (int, float))),
                   key=lambda v: v["val_loss"], default=None)
        if best is not None:
            rows.append(["best validation loss", f"{best['val_loss']:.4f} at step {best['step']}"])
    return "<h2>Summary</h2>" + _table(None, rows, numeric_from=9)


def curves_section(charts: dict[str, bytes], metrics: RunRecords, run: Path) -> str:
    names = [("loss.png", "loss and validation loss"), ("lr.png", "learning rate"), ("grad_norm.png", "grad norm"),
             ("tokens_per_s.png", "tokens per second"), ("memory.png", "peak memory")]
    parts = ["<h2>Training curves</h2>"]
    if not metrics.steps and not metrics.validation:
        return parts[0] + _missing(f"No training metrics: {run / 'metrics.jsonl'} is missing or empty.")
    if metrics.steps and not metrics.validation:
        parts.append(_missing("No validation loss in metrics.jsonl (train with --val-data FILE or --val-split F)."))
    parts.append('<div class="charts">' + "".join(_img(n, charts[n], alt) for n, alt in names if n in charts)
                 + "</div>")
    return "".join(parts)


def plan_section(plan: dict | None, charts: dict[str, bytes], run: Path) -> str:
    head = "<h2>Planned memory</h2>"
    if plan is None:
        return head + _missing(f"No plan.json in {run}: the planner's memory breakdown appears here when the "
                               f"run folder has one (hivetune plan ... --json > {run / 'plan.json'}).")
    parts = [head]
    breakdown = plan_breakdown(plan)
    if breakdown:
        parts.append(_img("plan_memory.png", charts["plan_memory.png"], "planned memory breakdown"))
        rows = [[html.escape(n), f"{b / GIB:.3f}"] for n, b in breakdown]
        total = plan_peak_bytes(plan)
        if total is not None:
            rows.append(["<b>predicted peak</b>", f"<b>{total / GIB:.3f}</b>"])
        parts.append(_table(["component", "GiB"], rows))
        if plan.get("gpu") or plan.get("memory_gib"):
            fits = {True: "fits", False: "does not fit"}.get(plan.get("fits"), "")
            parts.append(f"<p>{html.escape(str(plan.get('gpu') or ''))} {html.escape(str(plan.get('memory_gib', '')))} GiB"
                         f"{': ' + fits if fits else ''}. {html.escape(str(plan.get('suggestion') or ''))}</p>")
    else:
        parts.append(_missing("plan.json has no breakdown (hivetune plan --json's parts_gib); its content follows."))
    parts.append(f"<details><summary>plan.json</summary><pre>{html.escape(json.dumps(plan, indent=2))}</pre></details>")
    return "".join(parts)


def ab_section(ev: dict | None, charts: dict[str, bytes], run: Path, n_examples: int = 3) -> str:
    head = "<h2>A/B: base vs tuned</h2>"
    if ev is None:
        return head + _missing(f"No eval/eval.json in {run}: run `hivetune eval --adapter {run}`.")
    means = ev.get("means", {})
    if not {"base", "tuned"} <= set(means):
        return head + _missing("eval/eval.json has no base and tuned means.")
    base, tuned = means["base"], means["tuned"]
    metrics = [("response loss", "loss", "num", -1), ("perplexity", "perplexity", "num", -1),
               ("exact match", "exact_match", "pct", 1), ("token F1", "f1", "pct", 1),
               ("ROUGE-L", "rouge_l", "pct", 1), ("command hit", "command_hit", "pct", 1)]
    rows = []
    for label, key, kind, sign in metrics:
        b, t = base.get(key), tuned.get(key)
        if b is None and t is None:
            continue
        show = (lambda v: "n/a" if v is None else f"{100 * v:.1f}%") if kind == "pct" else _num
        if b is None or t is None:
            change = "n/a"
        else:
            delta = t - b
            css = "better" if delta * sign > 0 else "worse" if delta * sign < 0 else ""
            text = f"{100 * delta:+.1f} pts" if kind == "pct" else f"{delta:+.4f}"
            change = f'<span class="{css}">{text}</span>'
        if key == "command_hit" and base.get("command_examples"):
            n = base["command_examples"]
            rows.append([label, f"{show(b)} ({base.get('command_hits')}/{n})", f"{show(t)} ({tuned.get('command_hits')}/{n})",
                         change])
        else:
            rows.append([label, show(b), show(t), change])
    seconds = ev.get("seconds", {}).get("total")
    parts = [head, f"<p>{html.escape(str(ev.get('examples', '?')))} examples of {html.escape(str(ev.get('data', '?')))}, "
                   f"greedy answers of at most {html.escape(str(ev.get('max_new_tokens', '?')))} tokens"
                   + (f", {seconds:.1f} s" if isinstance(seconds, (int, float)) else "") + ".</p>",
             _table(["metric", "base", "tuned", "change"], rows)]
    if "eval.png" in charts:
        parts.append(_img("eval.png", charts["eval.png"], "base vs tuned scores"))
    for row in ev.get("rows", [])[:n_examples]:
        b, t = row.get("base", {}), row.get("tuned", {})
        parts.append(f"<h3>{html.escape(str(row.get('where', '')))}</h3>"
                     f"<p><b>Question</b></p><pre>{html.escape(str(row.get('question', '')))}</pre>"
                     f"<p><b>Reference</b></p><pre>{html.escape(str(row.get('reference', '')))}</pre>"
                     + _table(["", "base", "tuned"], [
                         ["answer", f"<pre>{html.escape(str(b.get('generation', '')))}</pre>",
                          f"<pre>{html.escape(str(t.get('generation', '')))}</pre>"],
                         ["loss", _num(b.get("loss")), _num(t.get("loss"))],
                         ["command hit", html.escape(str(b.get("command_hit"))), html.escape(str(t.get("command_hit")))],
                     ], numeric_from=9))
    return "".join(parts)


def config_section(run: Path) -> str:
    path = run / "config.yaml"
    if not path.is_file():
        return "<h2>Config</h2>" + _missing(f"No config.yaml in {run}.")
    return f"<h2>Config</h2><pre>{html.escape(path.read_text(errors='replace'))}</pre>"


def environment_section(summary: dict | None) -> str:
    recorded = (summary or {}).get("environment")
    if isinstance(recorded, dict) and recorded:
        env, note = recorded, "as recorded by the run (summary.json)"
    else:
        env, note = environment(), "the run recorded none (no summary.json environment): this is the machine that drew the report"
    rows = [[html.escape(str(k)), html.escape(str(v))] for k, v in env.items()]
    return f"<h2>Environment</h2><p>{html.escape(note)}</p>" + _table(None, rows, numeric_from=9)


def render_html(run: Path, metrics: RunRecords, plan: dict | None, ev: dict | None, summary: dict | None,
                charts: dict[str, bytes]) -> str:
    body = "".join([
        f"<h1>hivetune run {html.escape(run.name)}</h1>",
        summary_section(run, summary, metrics), ab_section(ev, charts, run), curves_section(charts, metrics, run),
        plan_section(plan, charts, run), config_section(run),
        environment_section(summary),
    ])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>hivetune report: '
            f"{html.escape(run.name)}</title><style>{CSS}</style></head><body>{body}</body></html>\n")


# ---------------------------------------------------------------- the command


def report(run: str | Path, out: str | Path = "") -> dict:
    """`hivetune report`: draw the charts, write report.html and the PNGs into `out` (default
    RUN/report), replacing an earlier report there as a whole. Returns what was written."""
    run = Path(run)
    if not run.is_dir():
        raise UserError(f"{run}: run folder not found")
    if not any((run / name).exists() for name in ("metrics.jsonl", "config.yaml", "summary.json", "eval")):
        raise UserError(f"{run}: not a run folder (no metrics.jsonl, config.yaml, summary.json or eval/)")
    out_dir = Path(out) if out else run / "report"
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out: {out_dir} is a file, expected a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / REPORT_HTML).is_file():
        raise UserError(f"--out: {out_dir} is not empty and holds no {REPORT_HTML}; choose another folder")
    require_matplotlib()

    metrics = read_metrics(run / "metrics.jsonl")
    plan = read_json(run / "plan.json")
    ev = read_json(run / "eval" / "eval.json")
    summary = read_json(run / "summary.json")
    charts = draw_charts(metrics, plan, ev)
    page = render_html(run, metrics, plan, ev, summary, charts)

    # All files into a fresh sibling folder, then swapped in: a reader sees the old report or the
    # new one, never a mix (a crash leaves a .tmp folder at worst, which the next call removes).
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, png in charts.items():
            (tmp / name).write_bytes(png)
        (tmp / REPORT_HTML).write_text(page, encoding="utf-8")
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            old.rename(out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return {"out": str(out_dir), "html": str(out_dir / REPORT_HTML), "pngs": sorted(charts),
            "steps": len(metrics.steps), "validations": len(metrics.validation),
            "plan": plan is not None, "eval": ev is not None}
