"""hivetune tune on a tiny model on the CPU: the measured table, the choice, the YAML it writes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from hivetune.cli import main
from hivetune.core.config import load_config
from hivetune.workflows.tune import format_tune, tune


def test_tune_picks_the_fastest_fitting_candidate(tiny_model_dir, tmp_path):
    cfg = load_config(None, {"model": str(tiny_model_dir), "batch_size": 4, "grad_accum": 1, "precision": "fp32",
                             "device": "cpu", "threads": 1, "max_length": 64, "lora": {"r": 4}})
    out = tmp_path / "tune.yaml"
    result = tune(cfg, batch_sizes=[1, 2, 4], steps=2, length=32, out=str(out))
    # 3 micro-batch sizes x checkpointing off / on x one back-end on the CPU
    assert [(r.batch_size, r.grad_accum, r.gradient_checkpointing) for r in result.rows] == [
        (1, 4, False), (2, 2, False), (4, 1, False), (1, 4, True), (2, 2, True), (4, 1, True)]
    assert all(r.status == "ok" and r.step_seconds > 0 and r.attention == "reference" for r in result.rows)
    assert result.best is min(result.rows, key=lambda r: r.step_seconds)
    written = yaml.safe_load(out.read_text())
    assert written == {"batch_size": result.best.batch_size, "grad_accum": result.best.grad_accum,
                       "gradient_checkpointing": result.best.gradient_checkpointing}
    reloaded = load_config(str(out), {"model": str(tiny_model_dir)})
    assert reloaded.batch_size * reloaded.grad_accum == 4
    assert "<- fastest" in format_tune(result)


def test_tune_cap_skips_and_errors(tiny_model_dir, tmp_path, capsys):
    cfg = load_config(None, {"model": str(tiny_model_dir), "batch_size": 2, "precision": "fp32", "device": "cpu",
                             "threads": 1, "max_length": 64, "lora": {"r": 4}})
    result = tune(cfg, batch_sizes=[1, 2], steps=2, length=16, cap_gib=1e-6, out=None)
    assert result.best is None and {r.status for r in result.rows} == {"over cap (predicted)"}
    out = tmp_path / "t.yaml"
    out.write_text("batch_size: 1\n")
    args = ["tune", "--model", str(tiny_model_dir), "--device", "cpu", "--batch-size", "2", "--max-length", "64",
            "--out", str(out)]
    assert main(args) == 2 and "already exists (--force to overwrite)" in capsys.readouterr().err
    assert main(args[:-2] + ["--batch-sizes", "3", "--out", str(tmp_path / "u.yaml")]) == 2
    assert "--batch-sizes: 3 does not divide the effective batch" in capsys.readouterr().err


def test_tune_predicts_lora_inputs_auto_as_train_resolves_it_and_pins_it():
    """Each candidate's prediction resolves lora_inputs auto as train will (at its micro-batch,
    within the process's memory and the cap): W2's 7B shape, 16 x 256 tokens, r 32 with dropout
    on a GPU keeps the dropped inputs within 80 GiB, and the predicted peak counts them; within
    24 GiB it recomputes. The resolved value is what the candidate trains with (and tune.yaml
    writes); keep / recompute asked for stay; nothing is resolved without seeded dropout."""
    from hivetune.workflows.workloads import WORKLOADS
    from hivetune.plan.memory import GIB, breakdown, keep_inputs_extra_bytes
    from hivetune.workflows.tune import _candidate_memory

    args, tokens = WORKLOADS["W2"].args, 16 * 256
    cfg = load_config(None, {"model": "m", "precision": "bf16", "lora": {"r": 32, "dropout": 0.05}})
    assert cfg.lora_inputs == "auto"
    roomy, kept = _candidate_memory(cfg, args, "bf16", False, True, tokens, 80 * GIB)
    tight, recomputed = _candidate_memory(cfg, args, "bf16", False, True, tokens, 24 * GIB)
    assert (kept, roomy.keep_inputs, recomputed, tight.keep_inputs) == ("keep", True, "recompute", False)
    gap = breakdown(args, roomy, tokens).total - breakdown(args, tight, tokens).total
    # the kept inputs (6.3 GiB here), plus the allocator slack the planner adds on top of them
    assert gap == pytest.approx(keep_inputs_extra_bytes(args, tight, tokens), rel=1e-2) and gap > 2 * GIB
    asked = dataclasses.replace(cfg, lora_inputs="recompute")
    assert _candidate_memory(asked, args, "bf16", False, True, tokens, 80 * GIB)[1] == "recompute"
    no_dropout = load_config(None, {"model": "m", "precision": "bf16", "lora": {"r": 32, "dropout": 0.0}})
    assert _candidate_memory(no_dropout, args, "bf16", False, True, tokens, 80 * GIB)[1] == "auto"
    assert _candidate_memory(cfg, args, "fp32", False, False, tokens, 0)[1] == "auto"  # the CPU


def test_tune_times_steps_read_as_they_end(tiny_model_dir, monkeypatch):
    """tune dates steps by their log records, so its runs read each step as it ends: a CUDA run
    with fused AdamW would otherwise batch the reads (StepLedger) and the host, running ahead,
    would date graphed steps a few ms apart (398,000 tokens/s for W1's shape on an H200)."""
    from types import SimpleNamespace

    import hivetune.train.loop as train_module

    cuda_run = SimpleNamespace(device=torch.device("cuda"), scaler=None,
                               optimizer=SimpleNamespace(defaults={"fused": True}), read_every_step=False)
    assert train_module.defer_steps(cuda_run)
    cuda_run.read_every_step = True
    assert not train_module.defer_steps(cuda_run)
    seen = []
    real_fit = train_module.fit
    monkeypatch.setattr(train_module, "fit",
                        lambda run, **kw: (seen.append(run.read_every_step), real_fit(run, **kw))[1])
    cfg = load_config(None, {"model": str(tiny_model_dir), "batch_size": 2, "precision": "fp32", "device": "cpu",
                             "threads": 1, "max_length": 64, "lora": {"r": 4}})
    tune(cfg, batch_sizes=[2], steps=2, length=16, out=None)
    assert seen == [True, True]  # checkpointing off and on


def test_memory_savers_keep_a_micro_batch_whole_graphed_or_offloaded():
    """W2's 7B shape in 24 GiB: its 2,896-token micro-batch does not fit as it is. The savers are
    the fewest first layers checkpointed with graphs on (host embeddings first where that takes
    fewer) and the fewest offloaded layers, eager; each fits its prediction and one layer fewer
    does not. A smaller micro-batch that graphs would run keeps its graphs with the embedding on
    the host alone. None off CUDA."""
    from hivetune.workflows.workloads import WORKLOADS
    from hivetune.plan.graph_sizes import bucket_tokens
    from hivetune.plan.memory import GIB, breakdown
    from hivetune.plan.planner import memory_config
    from hivetune.workflows.tune import memory_savers

    args, budget = WORKLOADS["W2"].args, 24 * GIB
    cfg = load_config(None, {"model": "m", "precision": "bf16", "lora_inputs": "recompute",
                             "lora": {"r": 32, "alpha": 64, "dropout": 0.05}})
    assert breakdown(args, memory_config(cfg, "bf16", False), 2896).total > budget
    (ckpt, ckpt_peak), (offload, offload_peak) = memory_savers(cfg, args, "bf16", 2896, budget, True)
    assert ckpt == {"host_embeddings": True, "gradient_checkpointing": True, "checkpoint_layers": 4}
    assert offload == {"host_embeddings": True, "activation_offload": 1}

    def graphed_peak(layers):
        changed = dataclasses.replace(cfg, **{**ckpt, "checkpoint_layers": layers})
        return breakdown(args, memory_config(changed, "bf16", True, graphs=True), bucket_tokens(2896)).total

    assert graphed_peak(4) == ckpt_peak <= budget < graphed_peak(3)
    eager = dataclasses.replace(cfg, host_embeddings=True)
    assert offload_peak == breakdown(args, memory_config(dataclasses.replace(eager, activation_offload=1), "bf16",
                                                         False), 2896).total <= budget
    assert breakdown(args, memory_config(eager, "bf16", False), 2896).total > budget
    small = memory_savers(cfg, args, "bf16", 2048, budget, True)
    assert [changes for changes, _ in small] == [{"gradient_checkpointing": True, "checkpoint_layers": 1},
                                                 {"host_embeddings": True}]
    assert memory_savers(cfg, args, "bf16", 2896, budget, False) == []


def test_tune_times_the_savers_of_a_micro_batch_over_the_cap_and_auto_takes_them(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """A micro-batch over the cap as it is gets a row per memory saver, timed with the saver's
    keys (here on the CPU, partial checkpointing of the tiny model's first layer); the fastest
    fitting row's keys go into tune.yaml, and --auto applies them."""
    import hivetune.workflows.tune as tune_module
    from hivetune.plan.auto import auto_config

    seen = []
    real = tune_module._time_candidate

    def timed(c, *rest):
        seen.append((c.batch_size, c.gradient_checkpointing, c.checkpoint_layers))
        return real(c, *rest)

    saver = {"gradient_checkpointing": True, "checkpoint_layers": 1}
    monkeypatch.setattr(tune_module, "memory_savers", lambda c, args, precision, tokens, budget, cuda: [(saver, 1.0)])
    monkeypatch.setattr(tune_module, "_time_candidate", timed)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, {"model": str(tiny_model_dir), "batch_size": 2, "precision": "fp32", "device": "cpu",
                             "threads": 1, "max_length": 64, "lora": {"r": 4}})
    result = tune(cfg, batch_sizes=[1, 2], steps=2, length=16, cap_gib=1e-6, out="tune.yaml")
    assert [(r.batch_size, r.gradient_checkpointing, r.status, r.saver) for r in result.rows] == [
        (1, False, "over cap (predicted)", {}), (1, True, "ok", saver), (2, False, "over cap (predicted)", {}),
        (2, True, "ok", saver), (1, True, "over cap (predicted)", {}), (2, True, "over cap (predicted)", {})]
    assert seen == [(1, True, 1), (2, True, 1)]
    assert result.best in (result.rows[1], result.rows[3])
    assert yaml.safe_load((tmp_path / "tune.yaml").read_text()) == {
        "batch_size": result.best.batch_size, "grad_accum": 2 // result.best.batch_size, **saver}
    assert "(gradient_checkpointing=True, checkpoint_layers=1)" in format_tune(result)
    new, why = auto_config(cfg, "cpu")
    assert (new.batch_size, new.gradient_checkpointing, new.checkpoint_layers) == (result.best.batch_size, True, 1)
    assert "checkpointing on, checkpoint_layers 1 (measured fastest)" in why, why
