"""hivetune report: the charts, the self-contained page, missing sections, bad input, atomic
replacement; and a real run folder (tiny model) drawn end to end."""

from __future__ import annotations

import base64
import io
import json
import re
import sys
from pathlib import Path

import pytest

from hivetune.cli import main
from hivetune.core.errors import UserError

pytest.importorskip("matplotlib", reason="hivetune report draws with matplotlib: pip install 'hivetune[plots]'")
from PIL import Image  # noqa: E402  (matplotlib depends on Pillow)

from hivetune.workflows.report import plan_breakdown, read_metrics, report  # noqa: E402

CURVES = ["grad_norm.png", "loss.png", "lr.png", "memory.png", "tokens_per_s.png"]


def step_record(step: int, loss) -> dict:
    return {"step": step, "epoch": step / 10, "loss": loss, "lr": 1e-3 * (1 - step / 20), "grad_norm": 1.0 / step,
            "tokens_per_s": 150.0 + step, "samples_per_s": 1.0, "peak_memory_bytes": (2 + step / 10) * 2**30,
            "elapsed_s": 6.0 * step, "skipped_steps": int(loss is None)}


def eval_json() -> dict:
    means = {"base": {"loss": 3.71, "perplexity": 40.85, "exact_match": 0.0, "f1": 0.21, "rouge_l": 0.15,
                      "command_hit": 0.05, "command_hits": 2, "command_examples": 40, "response_tokens": 3000},
             "tuned": {"loss": 2.50, "perplexity": 12.18, "exact_match": 0.0, "f1": 0.41, "rouge_l": 0.33,
                       "command_hit": 0.30, "command_hits": 12, "command_examples": 40, "response_tokens": 3000}}
    row = {"where": "heldout.jsonl:1", "question": "How do I <restart> nginx?", "reference": "$ systemctl restart nginx",
           "commands": ["systemctl restart nginx"],
           "base": {"generation": "Use <b>service</b>.", "loss": 3.2, "command_hit": False},
           "tuned": {"generation": "$ sudo systemctl restart nginx", "loss": 1.1, "command_hit": True}}
    return {"examples": 40, "data": "heldout.jsonl", "max_new_tokens": 96, "seconds": {"total": 61.5},
            "means": means, "rows": [row]}


def make_run(folder: Path, *, val=True, plan=True, ev=True, summary=True) -> Path:
    folder.mkdir(parents=True)
    records = [step_record(s, 3.5 - 0.1 * s if s != 4 else None) for s in range(1, 11)]
    if val:
        records.insert(5, {"step": 5, "val_loss": 3.1, "val_tokens": 500})
        records.append({"step": 10, "val_loss": 2.7, "val_tokens": 500})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "config.yaml").write_text("lr: 0.001\nlora:\n  r: 16\nnote: '<not a tag>'\n")
    if summary:
        (folder / "summary.json").write_text(json.dumps({
            "steps": 10, "final_loss": 2.5, "train_seconds": 60.0, "tokens_per_s": 155.0, "device": "cpu",
            "precision": "bf16", "peak_memory_bytes": 3 * 2**30,
            "environment": {"torch": "2.13.0", "cpu": "Test CPU", "commit": "abc1234"}}))
    if plan:
        (folder / "plan.json").write_text(json.dumps({  # `hivetune plan --json`'s fields
            "gpu": "H200", "memory_gib": 139.8, "fits": True, "suggestion": "fits with room to spare",
            "parts_gib": {"base weights": 1.0, "LoRA params": 1 / 1024, "optimizer state": 2 / 1024,
                          "activations": 1.5}, "peak_gib": 2.6}))
    if ev:
        (folder / "eval").mkdir()
        (folder / "eval" / "eval.json").write_text(json.dumps(eval_json()))
    return folder


def images(page: str) -> dict[str, bytes]:
    """data-file name -> decoded PNG of every <img> in the page."""
    found = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="[^"]*" data-file="([^"]+)">', page)
    return {name: base64.b64decode(data) for data, name in found}


def test_full_report_inlines_every_chart(tmp_path):
    run = make_run(tmp_path / "run")
    result = report(run)
    out = run / "report"
    assert result["out"] == str(out) and result["steps"] == 10 and result["validations"] == 2
    expected = sorted(CURVES + ["eval.png", "plan_memory.png"])
    assert result["pngs"] == expected
    assert sorted(p.name for p in out.iterdir()) == sorted(expected + ["report.html"])
    page = (out / "report.html").read_text()
    inlined = images(page)
    assert sorted(inlined) == expected
    for name, data in inlined.items():
        assert data == (out / name).read_bytes(), name  # the page holds exactly the PNG files
        with Image.open(io.BytesIO(data)) as im:
            assert im.format == "PNG" and im.size[0] == (750 if name in ("eval.png", "plan_memory.png") else 540) and im.size[1] > 100
    # self-contained: no other src / href than data URIs
    assert re.findall(r'(?:src|href)="(?!data:)', page) == []
    # A/B table: values, counts and signed changes with the right colour
    assert "<td>response loss</td><td class=\"num\">3.7100</td><td class=\"num\">2.5000</td>" in page
    assert '<span class="better">-1.2100</span>' in page
    assert "30.0% (12/40)" in page and '<span class="better">+25.0 pts</span>' in page
    # planner table, config and environment; user text is escaped
    assert "<td>activations</td><td class=\"num\">1.500</td>" in page
    assert "<b>predicted peak</b>" in page and "2.600" in page and "H200 139.8 GiB: fits. fits with room" in page
    assert "note: &#x27;&lt;not a tag&gt;&#x27;" in page and "<not a tag>" not in page
    assert "How do I &lt;restart&gt; nginx?" in page and "<b>service</b>" not in page
    assert "<td>commit</td><td>abc1234</td>" in page and "as recorded by the run" in page
    assert "best validation loss</td><td>2.7000 at step 10" in page
    assert "missing" not in re.sub(r"\.missing \{[^}]*\}", "", page)  # no section is missing


def test_missing_sections_say_so(tmp_path):
    run = make_run(tmp_path / "run", val=False, plan=False, ev=False, summary=False)
    result = report(run, tmp_path / "out")
    assert result["pngs"] == CURVES and not result["plan"] and not result["eval"]
    page = (tmp_path / "out" / "report.html").read_text()
    assert f"No plan.json in {run}: the planner&#x27;s memory breakdown appears here when" in page
    assert f"No eval/eval.json in {run}: run `hivetune eval --adapter {run}`." in page
    assert "No validation loss in metrics.jsonl (train with --val-data FILE or --val-split F)." in page
    assert "no summary.json: the run has not finished" in page
    assert "this is the machine that drew the report" in page
    assert sorted(images(page)) == CURVES


def test_plan_breakdown_forms():
    assert plan_breakdown({"parts_gib": {"a": 1, "b": 0.5}}) == [("a", 2.0**30), ("b", 2.0**29)]
    assert plan_breakdown({"breakdown": {"a": 1, "b": 2.5}}) == [("a", 1.0), ("b", 2.5)]
    assert plan_breakdown({"breakdown": [{"name": "w", "bytes": 4}, {"label": "x", "bytes": 5}]}) == [("w", 4.0), ("x", 5.0)]
    assert plan_breakdown({"breakdown": {"a": "many", "b": True, "c": float("nan")}}) is None
    assert plan_breakdown({"peak": 3}) is None


def test_unreadable_plan_is_shown_not_drawn(tmp_path):
    run = make_run(tmp_path / "run", plan=False)
    (run / "plan.json").write_text(json.dumps({"peak": 12345}))
    result = report(run)
    assert "plan_memory.png" not in result["pngs"]
    page = (run / "report" / "report.html").read_text()
    assert "plan.json has no breakdown (hivetune plan --json&#x27;s parts_gib)" in page and "&quot;peak&quot;: 12345" in page


def test_metrics_reading(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 1, "val_loss": 1.5, "val_tokens": 3}\n{"step": 2, "lo')
    records = read_metrics(path)  # a run still writing its last line
    assert [r["step"] for r in records.steps] == [1] and records.validation[0]["val_loss"] == 1.5
    assert records.skipped_lines == 1
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": "x"}\n')
    with pytest.raises(UserError, match=re.escape(f"{path}:2: bad metrics record (expected an object with an "
                                                  f"integer 'step')")):
        read_metrics(path)


def test_rerun_replaces_the_report_whole(tmp_path):
    run = make_run(tmp_path / "run")
    report(run)
    (run / "eval" / "eval.json").unlink()
    result = report(run)
    assert "eval.png" not in result["pngs"]
    assert sorted(p.name for p in (run / "report").iterdir()) == sorted(result["pngs"] + ["report.html"])
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "eval", "metrics.jsonl", "plan.json", "report",
                                                     "summary.json"]  # no temporary folders left


@pytest.mark.parametrize("case", ["missing", "not_a_run", "bad_metrics", "bad_json", "out_is_file", "out_foreign",
                                  "no_matplotlib"])
def test_bad_input_is_one_line_exit_2(case, tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path / "run")
    args = ["report", str(run)]
    expected = {
        "missing": f"{tmp_path / 'nope'}: run folder not found",
        "not_a_run": f"{tmp_path / 'empty'}: not a run folder (no metrics.jsonl, config.yaml, summary.json or eval/)",
        "bad_metrics": f"{run / 'metrics.jsonl'}:3: bad metrics record (Expecting value: line 1 column 1 (char 0))",
        "bad_json": f"{run / 'eval' / 'eval.json'}: expected a JSON object",
        "out_is_file": f"--out: {tmp_path / 'f'} is a file, expected a folder",
        "out_foreign": f"--out: {tmp_path / 'other'} is not empty and holds no report.html; choose another folder",
        "no_matplotlib": "report: drawing needs matplotlib, which is not installed: pip install 'hivetune[plots]' "
                         "(or pip install matplotlib)",
    }[case]
    if case == "missing":
        args[1] = str(tmp_path / "nope")
    elif case == "not_a_run":
        (tmp_path / "empty").mkdir()
        args[1] = str(tmp_path / "empty")
    elif case == "bad_metrics":
        lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
        lines[2] = "oops\n"
        (run / "metrics.jsonl").write_text("".join(lines))
    elif case == "bad_json":
        (run / "eval" / "eval.json").write_text("[1, 2]")
    elif case == "out_is_file":
        (tmp_path / "f").write_text("x")
        args += ["--out", str(tmp_path / "f")]
    elif case == "out_foreign":
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "keep.txt").write_text("mine")
        args += ["--out", str(tmp_path / "other")]
    elif case == "no_matplotlib":
        for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
            monkeypatch.setitem(sys.modules, name, None)
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"hivetune: error: {expected}"]
    assert not (run / "report").exists()
    if case == "out_foreign":
        assert [p.name for p in (tmp_path / "other").iterdir()] == ["keep.txt"]


def test_real_run_then_report_cli(tiny_model_dir, alpaca_file, tmp_path, capsys):
    """A tiny training run's own folder, drawn through the CLI."""
    run = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(alpaca_file), "--output", str(run),
                 "--max-steps", "3", "--batch-size", "4", "--precision", "fp32", "--device", "cpu", "--quiet",
                 "--set", "eval_prompts=0", "--set", "lora.r=4"]) == 0
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run / 'report' / 'report.html'}" in out
    page = (run / "report" / "report.html").read_text()
    assert set(CURVES) <= set(images(page))
    assert "lr: 0.0002" in page  # config.yaml as the run saved it
    assert "<td>optimizer steps</td><td>3</td>" in page
