"""`hivetune bench`'s results: one JSONL line per measurement in <workload>-<device>.jsonl, and the
BENCHMARKS table of the newest figure per workload, device and setting made from those files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hivetune.workflows import bench, bench_results

ROOT = Path(__file__).resolve().parents[2]

FAKE = {"steps": 1, "seconds": 1.0, "tokens_per_s": 1.0, "mfu": None, "peak_memory_allocated_gib": None,
        "peak_memory_reserved_gib": None, "micro_batch": "8 examples x 1"}


def record(date: str, seconds: float, setting: str = "defaults", **extra) -> dict:
    return {"workload": "W1", "device": "h200", "date": date, "commit": "abc1234", "setting": setting,
            "environment": {"gpu": "NVIDIA H200"},
            "hivetune": {"steps": 562, "seconds": seconds, "tokens_per_s": 298259 * 3 / seconds, "mfu": 0.2,
                         "peak_memory_allocated_gib": 3.05}, **extra}


def test_device_kind_and_setting_name_the_files_and_rows():
    assert bench_results.device_kind(None) == "cpu"
    assert bench_results.device_kind("NVIDIA H200") == "h200"
    assert bench_results.device_kind("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert bench_results.device_kind("NVIDIA H200", gpus=2) == "2xh200"
    assert bench_results.setting_text({}) == "defaults"
    assert (bench_results.setting_text({"host_embeddings": True}, 24.0, "cublaslt", 20)
            == "host_embeddings=True; memory cap 24 GiB; HIVETUNE_REFERENCE=cublaslt; max_steps 20")


def test_the_table_holds_the_newest_line_of_each_setting(tmp_path):
    lines = [record("2026-11-27T18:17:50+00:00", 8.2), record("2026-11-28T10:00:00+00:00", 7.9),
             record("2026-11-27T18:18:13+00:00", 8.8, "batch_order=random"),
             record("2026-11-28T11:00:00+00:00", 8.1, baseline={"name": "hf-peft", "tokens_per_s": 4683.0},
                    speedup_vs_baseline=24.1, setting="memory cap 4 GiB")]
    (tmp_path / "W1-h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + "not json\n")
    rows = [line for line in bench_results.results_table(tmp_path).splitlines() if line.startswith("| W1")]
    assert len(rows) == 3
    assert rows[0].startswith("| W1 | h200 | defaults | 2026-11-28 | abc1234 | 7.9 | 113,263 | 20.0% | 3.05 |")
    assert rows[1].startswith("| W1 | h200 | batch_order=random | 2026-11-27 |")
    assert rows[2].endswith("| hf-peft 4,683 | 24.1x |")


def test_bench_appends_a_line_and_rewrites_the_table_beside_its_results(tmp_path, monkeypatch):
    """A run written elsewhere (--out /tmp/x) leaves the table as it is; each run adds one line to
    its file and replaces none."""
    table = tmp_path / "BENCHMARKS.md"
    text = f"# B\n{bench_results.TABLE_BEGIN}\n| old row |\n{bench_results.TABLE_END}\n"
    table.write_text(text)
    monkeypatch.setattr(bench, "run_hivetune", lambda *a, **k: dict(FAKE))
    monkeypatch.setattr(bench, "host_probe", lambda device: {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    out = bench.bench("W1", max_steps=1, out_dir=str(tmp_path / "elsewhere"), table=str(table), commit="f00ba47")
    assert table.read_text() == text
    written = (tmp_path / "elsewhere" / "W1-cpu.jsonl").read_text().splitlines()
    assert len(written) == 1 and out["W1"]["path"].endswith("W1-cpu.jsonl")
    line = json.loads(written[0])
    assert line["commit"] == "f00ba47" == line["environment"]["commit"] and line["setting"] == "max_steps 1"
    assert isinstance(line["environment"]["process_s"], float) and line["environment"]["process_s"] > 0
    for _ in range(2):
        bench.bench("W1", max_steps=1, out_dir="benchmarks/results", table=str(table), commit="f00ba47")
    assert len((tmp_path / "benchmarks" / "results" / "W1-cpu.jsonl").read_text().splitlines()) == 2
    rows = [line for line in table.read_text().splitlines() if line.startswith("| W1")]
    assert "| old row |" not in table.read_text() and len(rows) == 1


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc")
def test_process_seconds_is_the_age_of_the_process():
    """The whole command's figure counts from the process's start, as ps counts it (to a second)."""
    import os
    import subprocess

    age = bench.process_seconds()
    ps = int(subprocess.check_output(["ps", "-o", "etimes=", "-p", str(os.getpid())], text=True))
    assert ps - 1.5 <= age <= ps + 1.5


def test_unknown_workload_is_a_user_error():
    with pytest.raises(bench.UserError, match="unknown workload 'W9'"):
        bench.bench("W9")


def test_the_checked_in_results_parse_and_fill_benchmarks_md():
    """Every line of benchmarks/results/*.jsonl is a record the table reads, and BENCHMARKS.md's
    generated table is the one those files make."""
    folder = ROOT / "benchmarks" / "results"
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            assert path.name == f"{row['workload']}-{row['device']}.jsonl", path.name
            # kernel benchmarks: rows of timings; start-up: figures per command
            assert {"date", "commit", "setting", "environment"} <= row.keys(), path.name
            assert {"hivetune", "kernels", "figures"} & row.keys(), path.name
    text = (ROOT / "BENCHMARKS.md").read_text()
    generated = text.split(bench_results.TABLE_BEGIN, 1)[1].split(bench_results.TABLE_END, 1)[0]
    assert generated.strip() == bench_results.results_table(folder).strip()


def test_the_w1_generator_gives_the_documented_token_counts():
    from hivetune.workflows.workloads import WORKLOADS, workload_examples

    w = WORKLOADS["W1"]
    examples = workload_examples(w.n_examples, w.args.vocab_size, w.cap)
    lengths = [len(e.ids) for e in examples]
    assert sum(lengths) == 298_259 and max(lengths) == 496
    assert sum(sum(e.mask) for e in examples) == 213_895
