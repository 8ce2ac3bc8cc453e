"""`hivetune bench` on the user's own job (--model --data): the JSON's figures and their
consistency, --repeat's spread, the HF baseline and its out-of-memory fallback, bad input; the
W4 workload's data and shape; train's summary.json rates."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from hivetune.cli import main
from hivetune.core.config import load_config
from hivetune.workflows import bench_job, hf_baseline
from hivetune.workflows.workloads import WORKLOADS

JOB = {"device": "cpu", "precision": "fp32", "batch_size": 4, "epochs": 2, "lr": 1e-2, "threads": 1,
       "lora": {"r": 4, "alpha": 8, "dropout": 0.0}}
HAS_PEFT = importlib.util.find_spec("peft") is not None and importlib.util.find_spec("transformers") is not None


def job_config(model, data, **kw):
    return load_config(None, {"model": str(model), "data": str(data), **JOB, **kw})


def test_w4_data_and_shape():
    w = WORKLOADS["W4"]
    lengths = [len(e.ids) for e in w.examples()]
    assert (len(lengths), sum(lengths), round(sum(lengths) / len(lengths)), max(lengths)) == (800, 831_370, 1_039, 4_023)
    a = w.args
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_hidden_layers, a.num_attention_heads,
            a.num_key_value_heads, a.head_dim, a.qk_norm, a.tie_word_embeddings, a.model_type) == (
        151936, 2048, 6144, 28, 16, 8, 128, True, True, "qwen3")
    assert (w.lora, w.examples_per_step, w.epochs, w.cap, w.hf_batches) == (
        {"r": 16, "alpha": 32, "dropout": 0.05}, 8, 1.0, 4096, (8, 4, 2))
    assert 4 * a.linear_weight_count == 6_881_804_288  # the 4N rule: 51,179 tokens/s on an H200 is 35.6% MFU
    w1 = [len(e.ids) for e in WORKLOADS["W1"].examples()]  # the W1 mix is unchanged
    assert (sum(w1), max(w1)) == (298_259, 496)


@pytest.mark.skipif(not HAS_PEFT, reason="needs transformers and peft")
def test_the_hf_baseline_builds_the_same_shapes():
    from hivetune.model.decoder import CausalLM

    for name in ("W1", "W4"):
        args = WORKLOADS[name].args
        hf = hf_baseline.random_hf_model(args, torch.device("meta"))
        with torch.device("meta"):
            ours = CausalLM(args)
        assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters()), name
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.head_dim == 128


def test_the_job_json_is_consistent_and_repeat_gives_the_spread(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    record = bench_job.bench_job(job_config(tiny_model_dir, alpaca_file), repeat=2, out=out)
    assert json.loads(out.read_text()) == {k: v for k, v in record.items() if k != "path"}
    env = record["environment"]
    assert {"gpu", "driver", "runtime", "torch", "hivetune"} <= env.keys()
    assert env["torch"] == torch.__version__ and env["gpu"] is None and env["runtime"] is None
    runs = record["hivetune"]["runs"]
    assert len(runs) == 2
    for r in runs:
        assert r["steps"] == 12 and r["samples"] == 48  # 24 examples, 2 epochs, 4 a step
        assert r["steps_per_s"] * r["runtime_s"] == pytest.approx(r["steps"], rel=1e-9)
        assert r["samples_per_s"] * r["runtime_s"] == pytest.approx(r["samples"], rel=1e-9)
        assert r["tokens_per_s"] * r["runtime_s"] == pytest.approx(r["tokens"], rel=1e-9)
        assert r["mfu"] is None and r["peak_memory_allocated_gib"] is None and r["peak_memory_reserved_gib"] is None
        assert len(r["epoch_losses"]) == 2 and all(math.isfinite(x) for x in r["epoch_losses"])
        assert r["precision"] == "fp32" and r["micro_batch"] == "4 x 1"
    assert runs[0]["final_loss"] == runs[1]["final_loss"]  # same seed, same job
    spread = record["hivetune"]["spread"]
    for key in ("runtime_s", "samples_per_s", "steps_per_s", "tokens_per_s", "final_loss"):
        values = sorted(r[key] for r in runs)
        assert spread[key] == {"min": values[0], "median": sum(values) / 2, "max": values[1]}
    assert "mfu" not in spread  # not measured on the CPU
    assert not list(tmp_path.glob("runs"))  # the runs' folders were temporary


@pytest.mark.skipif(not HAS_PEFT, reason="needs transformers and peft")
def test_the_hf_baseline_on_the_job(tiny_model_dir, alpaca_file, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(tiny_model_dir), "--data", str(alpaca_file), "--baseline", "hf-peft",
                 "--json", str(out), *[f"--set={k}={v}" for k, v in JOB.items() if k != "lora"],
                 "--set", "lora.r=4", "--set", "lora.alpha=8", "--set", "lora.dropout=0"]) == 0
    record = json.loads(out.read_text())
    [base] = record["baseline"]["runs"]
    assert base["batches_tried"] == ["4 x 1: ran"] and base["config"].startswith("batch 4 x accum 1, fp32")
    assert base["steps"] == 12 and base["samples"] == 48 and len(base["epoch_losses"]) == 2
    assert base["tokens"] == record["hivetune"]["runs"][0]["tokens"]  # the same examples, tokenised once
    assert base["steps_per_s"] * base["runtime_s"] == pytest.approx(12)
    assert record["speedup_vs_baseline"] > 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("hivetune: ") and lines[1].startswith("hf-peft: ") and lines[-1] == f"-> {out}"


def test_the_hf_baseline_takes_the_largest_batch_that_fits(monkeypatch):
    def fake(build_model, job, batch, device, timed_steps, warmup_steps):
        if batch > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"seconds": 1.0, "config": f"batch {batch}"}

    monkeypatch.setattr(hf_baseline, "_train_once", fake)
    job = hf_baseline.workload_job(WORKLOADS["W4"], torch.device("cpu"))
    assert job.batches == [8, 4, 2]
    record = hf_baseline.run_hf_job(lambda: None, job, torch.device("cpu"))
    assert record["batches_tried"] == ["8 x 1: out of memory", "4 x 2: out of memory", "2 x 4: ran"]
    assert record["config"] == "batch 2"
    monkeypatch.setattr(hf_baseline, "_train_once", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError()))
    assert hf_baseline.run_hf_job(lambda: None, job, torch.device("cpu"))["error"].startswith(
        "out of memory at every micro-batch tried (8 x 1: out of memory")
    assert bench_job.halvings(8, 8) == [8, 4, 2, 1] and bench_job.halvings(6, 12) == [6, 3]


@pytest.fixture
def pairs_file(tmp_path):
    from conftest import write_jsonl

    return write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"How do I restart service {i}?",
                                                   "chosen": f"systemctl restart svc{i}", "rejected": "Reboot twice."}
                                                  for i in range(16)])


@pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None,
                    reason="needs trl and datasets (hivetune[dev])")
def test_the_trl_baseline_on_a_dpo_job(tiny_model_dir, pairs_file, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(tiny_model_dir), "--data", str(pairs_file), "--baseline", "trl-dpo",
                 "--json", str(out), "--set", "method=dpo", "--max-steps", "3",
                 *[f"--set={k}={v}" for k, v in JOB.items() if k not in ("lora", "epochs")],
                 "--set", "lora.r=4", "--set", "lora.alpha=8", "--set", "lora.dropout=0"]) == 0
    record = json.loads(out.read_text())
    [ours], [base] = record["hivetune"]["runs"], record["baseline"]["runs"]
    assert base["config"] == "DPOTrainer defaults, batch 4, fp32" and base["measured"] == "full"
    assert (ours["steps"], base["steps"], base["samples"]) == (3, 3, 12)
    assert base["steps_per_s"] * base["runtime_s"] == pytest.approx(3)
    # DPO starts at ln 2 (the policy is the reference) and falls as it learns (measured: mean 0.657)
    assert 0.5 < base["train_loss"] < math.log(2)
    assert record["speedup_vs_baseline"] > 0
    # tokens/s on hivetune's count (each pair's prompt once); TRL runs the prompt twice (tokens_run_per_s)
    assert base["tokens_per_s"] == pytest.approx(base["pairs_per_s"] * ours["tokens"] / base["samples"], rel=0.05)
    assert base["tokens_run_per_s"] > 1.2 * base["tokens_per_s"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("hivetune: ") and lines[1].startswith("trl-dpo: ") and lines[-1] == f"-> {out}"


@pytest.mark.parametrize("args, message", [
    (["--data", "{pairs}", "--set", "method=dpo", "--baseline", "hf-peft"],
     "--baseline hf-peft trains SFT; this job's method is dpo (its baseline: --baseline trl-dpo)"),
    (["--data", "{data}", "--baseline", "trl-dpo"],
     "--baseline trl-dpo trains DPO; this job's method is sft (its baseline: --baseline hf-peft)"),
    (["--data", "{pairs}", "--set", "method=orpo", "--baseline", "trl-dpo"],
     "--baseline trl-dpo trains DPO; this job's method is orpo"),
])
def test_a_baseline_of_another_method_is_one_line(tiny_model_dir, alpaca_file, pairs_file, tmp_path, capsys, args,
                                                  message):
    fill = {"pairs": pairs_file, "data": alpaca_file}
    assert main(["bench", "--model", str(tiny_model_dir), "--json", str(tmp_path / "b.json"),
                 *[a.format(**fill) for a in args]]) == 2
    assert capsys.readouterr().err == f"hivetune: error: {message}\n"
    assert not (tmp_path / "b.json").exists()


def test_a_workload_keeps_its_method(capsys):
    assert main(["bench", "W1", "--set", "method=dpo"]) == 2
    assert capsys.readouterr().err == ("hivetune: error: --set method=dpo: workload W1 is sft (its data is made for it; "
                                       "PW1 is the preference workload); time your own job with --model and --data\n")


@pytest.mark.parametrize("args, message", [
    (["--model", "{tmp}/none", "--data", "{data}"], "--model: {tmp}/none not found"),
    (["--model", "{model}", "--data", "{tmp}/none.jsonl"], "--data: {tmp}/none.jsonl not found"),
    (["--model", "{model}", "--data", "{data}", "--repeat", "0"], "--repeat: must be >= 1, got 0"),
    (["W1", "--repeat", "0"], "--repeat: applies to your own job (--model DIR --data FILE)"),
    (["W1", "--model", "{model}", "--data", "{data}"], "bench: give a workload (W1) or --model / --data / --config, "
                                                     "not both"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_model_dir, alpaca_file, tmp_path, capsys, args, message):
    fill = {"tmp": tmp_path, "model": tiny_model_dir, "data": alpaca_file}
    assert main(["bench", *[a.format(**fill) for a in args]]) == 2
    assert capsys.readouterr().err == f"hivetune: error: {message.format(**fill)}\n"


def test_a_missing_baseline_package_is_one_line(tiny_model_dir, alpaca_file, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(bench_job.UserError, match=r"^--baseline hf-peft needs peft \(pip install 'hivetune\[dev\]'\)$"):
        bench_job.bench_job(job_config(tiny_model_dir, alpaca_file), baseline="hf-peft")


def test_train_summary_has_samples_and_steps_per_second(tiny_model_dir, alpaca_file, tmp_path):
    from hivetune.workflows.train_job import train

    out = tmp_path / "run"
    result = train(job_config(tiny_model_dir, alpaca_file, output_dir=str(out), max_steps=3, eval_prompts=0),
                   progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_per_s"] == pytest.approx(3 / result.seconds, rel=1e-3)
    assert summary["samples_per_s"] == pytest.approx(12 / result.seconds, rel=1e-3)


def test_a_w4_like_workload_runs_both_sides_on_the_cpu():
    """W4's path at a tiny size: a Qwen3-shaped random model, the long-tail mix, HF largest batch first."""
    from hivetune.model.config import qwen3_shape
    from hivetune.workflows import bench
    from hivetune.workflows.workloads import LONG_TAIL, Workload

    w = Workload("W4-tiny", qwen3_shape(2100, 64, 128, 2, 4, 2, 32, True), 16, 256, 1.0, 8,
                 {"r": 4, "alpha": 8, "dropout": 0.05}, lengths=LONG_TAIL, hf_batches=(8, 4, 2))
    cpu = torch.device("cpu")
    ours = bench.run_hivetune(w, cpu)
    lengths = [len(e.ids) for e in w.examples()]
    assert ours["steps"] == 2 and ours["tokens"] == sum(lengths) and max(lengths) == 256
    assert 0 < ours["attention_flops_share"] < 1 and ours["mfu"] is None
    if HAS_PEFT:
        theirs = bench.run_hf_peft(w, cpu)
        assert theirs["batches_tried"] == ["8 x 1: ran"] and theirs["steps_run"] == 2


def test_a_runs_record_holds_the_plan_against_what_it_measured(monkeypatch):
    """bench.plan_against on a CUDA device (faked: an H200 that measured 3.0 / 3.2 GiB and 8.0 s):
    the plan's peak less the CUDA context and the allocator's slack against the allocated peak,
    less the context against the reserved one, its step time x steps against the seconds."""
    from hivetune.plan import plan
    from hivetune.workflows import bench

    w = WORKLOADS["W1"]
    cfg = load_config(None, {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda",
                             "batch_size": 8, "lora": w.lora, "max_length": 4096})
    examples = w.data()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3.0 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 3.2 * 2**30)
    got = bench.plan_against(cfg, torch.device("cuda"), 562, 8.0, model_args=w.args, index=examples)
    p = plan(cfg, gpu="H200", model_args=w.args, index=examples)
    allocated = p.peak_gib - p.parts_gib["CUDA context"] - p.parts_gib["allocator slack"]
    assert got["planned_allocated_gib"] == round(allocated, 3)
    assert got["allocated_gib_error_pct"] == round(100 * (allocated / 3.0 - 1), 1)
    assert got["reserved_gib_error_pct"] == round(100 * ((p.peak_gib - p.parts_gib["CUDA context"]) / 3.2 - 1), 1)
    assert got["planned_seconds"] == round(p.step_seconds * 562, 3) and got["micro_batch_tokens"] == 1792
    assert bench.plan_against(cfg, torch.device("cpu"), 562, 8.0) is None
