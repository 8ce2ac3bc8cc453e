"""bench's record of what a result ran with: experiments (switches under trial, where set) are in
each result's environment and in the BENCHMARKS table row, so that an A/B's two sides differ there."""

from __future__ import annotations

import json

import torch

from hivetune.workflows import bench
def test_an_experiment_switch_is_recorded_and_shown_in_the_table(tmp_path, monkeypatch):
    for name in bench.EXPERIMENTS:
        monkeypatch.delenv(name, raising=False)
    assert bench.environment(torch.device("cpu"))["experiments"] == ""
    monkeypatch.setenv("HIVETUNE_LORA_SIDE_STREAM", "0")
    monkeypatch.setenv("HIVETUNE_CAPTURE_LEAD", "3")
    env = bench.environment(torch.device("cpu"))
    assert env["experiments"] == "HIVETUNE_LORA_SIDE_STREAM=0 HIVETUNE_CAPTURE_LEAD=3"
    record = {"workload": "W1", "date": "2026-11-26T17:00:00+00:00", "environment": env,
              "hivetune": {"steps": 562, "seconds": 10.0, "tokens_per_s": 89_000.0, "mfu": 0.17,
                           "peak_memory_allocated_gib": 3.7, "peak_memory_reserved_gib": 3.9,
                           "micro_batch": "8 examples x 1", "memory_cap_gib": 4.0, "first_step_s": 6.37,
                           "adapter_save_s": 0.45, "activation_offload": {"passes": 4, "layers": 7}}}
    (tmp_path / "W1-20261126-170000.json").write_text(json.dumps(record))
    plain = dict(record, environment=dict(env, experiments=""))
    (tmp_path / "W1-20261126-165900.json").write_text(json.dumps(plain))
    rows = [line for line in bench.results_table(tmp_path).splitlines() if line.startswith("| W1")]
    assert len(rows) == 2
    assert ("defaults; experiments: HIVETUNE_LORA_SIDE_STREAM=0 HIVETUNE_CAPTURE_LEAD=3; allocator capped at 4 GiB"
            in rows[0])
    assert "; first step 6.37 s; adapter write 0.45 s after the clock; 1.8 layers offloaded a micro-batch" in rows[0]
    assert "experiments" not in rows[1] and "W1-20261126-165900.json" in rows[1]


def test_a_bench_run_written_elsewhere_leaves_the_table(tmp_path, monkeypatch):
    """bench rewrites BENCHMARKS.md's table only when its results go to bench/results beside the
    table: `--out /tmp/x` left the table holding /tmp/x's one row (a session's table was wiped so)."""
    table = tmp_path / "BENCHMARKS.md"
    text = f"# B\n{bench.TABLE_BEGIN}\n| old row |\n{bench.TABLE_END}\n"
    table.write_text(text)
    fake = {"steps": 1, "seconds": 1.0, "tokens_per_s": 1.0, "mfu": None, "peak_memory_allocated_gib": None,
            "peak_memory_reserved_gib": None, "micro_batch": "8 examples x 1"}
    monkeypatch.setattr(bench, "run_hivetune", lambda *a, **k: dict(fake))
    monkeypatch.setattr(bench, "host_probe", lambda device: {})
    monkeypatch.chdir(tmp_path)
    bench.bench("W1", max_steps=1, out_dir=str(tmp_path / "elsewhere"), table=str(table))
    assert table.read_text() == text and len(list((tmp_path / "elsewhere").glob("W1-*.json"))) == 1
    bench.bench("W1", max_steps=1, out_dir="bench/results", table=str(table))
    rows = [line for line in table.read_text().splitlines() if line.startswith("| W1")]
    assert "| old row |" not in table.read_text() and len(rows) == 1
