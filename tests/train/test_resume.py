"""Checkpoints and resume, in process: bitwise resume, bad checkpoints skipped, config and
plan checks, the CLI's --resume, and non-finite steps skipped then stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ops_records, write_jsonl
from hivetune import checkpoint as ckpt
from hivetune.checkpoint import checkpoint_folders, verify_checkpoint
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.model.lora import lora_state_dict
from hivetune.train.loop import TrainingStopped, fit
from hivetune.train.setup import setup
from conftest import tiny_config

DROPOUT = {"r": 4, "alpha": 8, "dropout": 0.1}  # dropout draws random numbers: the RNG state matters


def run_cfg(model_dir, data, out, **kw):
    values = {"max_steps": 6, "save_every": 2, "lora": DROPOUT, "seed": 7}
    values.update(kw)
    return tiny_config(model_dir, data, out, **values)


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def same_numbers(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"], r["epoch"], r["skipped_steps"]) for r in rows]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", ops_records(24))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, data, tmp_path_factory):
    """6 steps, never interrupted: (adapter tensors, metrics rows)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    run = setup(run_cfg(tiny_model_dir, data, out))
    fit(run, progress=False)
    return lora_state_dict(run.model), metric_rows(out), out


def interrupted_then_resumed(model_dir, data, out, stop_after=3, **kw):
    run = setup(run_cfg(model_dir, data, out, **kw))
    with pytest.raises(TrainingStopped) as stopped:
        fit(run, progress=False, stop_after=stop_after)
    assert stopped.value.step == stop_after and stopped.value.signum is None
    resumed = setup(run_cfg(model_dir, data, out, **kw))
    return resumed


def test_resume_after_crash_is_bitwise_equal(tiny_model_dir, data, reference, tmp_path):
    out = tmp_path / "run"
    run = interrupted_then_resumed(tiny_model_dir, data, out)
    assert run.start_step == 2  # crashed after step 3; the newest checkpoint is step 2
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    fit(run, progress=False)
    assert_bitwise_equal(lora_state_dict(run.model), reference[0])
    on_disk = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert_bitwise_equal(on_disk, reference[0])
    assert same_numbers(metric_rows(out)) == same_numbers(reference[1])  # steps 1..6 once each


def test_resume_without_rng_state_differs(tiny_model_dir, data, reference, tmp_path, monkeypatch):
    """The check above can fail: with dropout, skipping the RNG restore changes the result."""
    monkeypatch.setattr(ckpt, "restore_rng", lambda state: None)
    run = interrupted_then_resumed(tiny_model_dir, data, tmp_path / "run")
    fit(run, progress=False)
    ours = lora_state_dict(run.model)
    assert any(not torch.equal(ours[k], reference[0][k]) for k in ours)


def test_checkpoint_files_manifest_and_weights_only(tiny_model_dir, data, reference):
    out = reference[2]
    folders = checkpoint_folders(out / "checkpoints")
    assert [f.name for f in folders] == ["step-000004", "step-000006"]  # every 2 steps and the end; keep 2
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    last = folders[-1]
    assert sorted(p.name for p in last.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                      "manifest.json", "trainer_state.pt"]
    manifest = json.loads((last / "manifest.json").read_text())
    assert manifest["step"] == 6 and sorted(manifest["files"]) == ["adapter_config.json",
                                                                   "adapter_model.safetensors", "trainer_state.pt"]
    assert manifest["config_sha256"] == ckpt.config_hash(out)
    state = torch.load(last / "trainer_state.pt", weights_only=True)
    assert state["step"] == 6 and state["plan_length"] == 6 and state["examples"] == 24
    assert state["rng"]["torch"].dtype == torch.uint8 and state["rng"]["python"].numel() == 625
    assert set(state["optimizer"]["state"]) == set(range(len(state["optimizer"]["param_groups"][0]["params"])))
    assert state["scheduler"]["last_epoch"] == 6 and state["counters"]["skipped_steps"] == 0
    assert_bitwise_equal(load_file(str(last / "adapter_model.safetensors")), reference[0])
    assert verify_checkpoint(last) == ""


@pytest.mark.parametrize("damage", ["no_manifest", "flipped_byte", "truncated", "missing_file"])
def test_damaged_checkpoint_is_skipped_with_a_warning(damage, tiny_model_dir, data, reference, tmp_path, capsys):
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out, keep_checkpoints=3))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=5)
    newest = out / "checkpoints" / "step-000004"
    state = newest / "trainer_state.pt"
    if damage == "no_manifest":
        (newest / "manifest.json").unlink()
    elif damage == "flipped_byte":
        raw = bytearray(state.read_bytes())
        raw[len(raw) // 2] ^= 1
        state.write_bytes(bytes(raw))
    elif damage == "truncated":
        state.write_bytes(state.read_bytes()[:-100])
    else:
        (newest / "adapter_model.safetensors").unlink()
    assert verify_checkpoint(newest) != ""
    capsys.readouterr()
    resumed = setup(run_cfg(tiny_model_dir, data, out, keep_checkpoints=3))
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"hivetune: warning: {newest}: ")
    assert warning[0].endswith("; using the previous checkpoint")
    assert resumed.start_step == 2
    fit(resumed, progress=False)  # writes a good step-000004 over the bad one
    assert_bitwise_equal(lora_state_dict(resumed.model), reference[0])
    assert all(verify_checkpoint(f) == "" for f in checkpoint_folders(out / "checkpoints"))


def test_output_of_a_run_with_the_same_config_resumes_it(tiny_model_dir, data, reference, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(out), "--max-steps", "6",
            "--save-every", "2", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "0", "--precision", "fp32",
            "--device", "cpu", "--threads", "1", "--seed", "7", "--lora-r", "4", "--lora-alpha", "8",
            "--lora-dropout", "0.1", "--quiet", "--set", "eval_prompts=0"]
    run = setup(run_cfg(tiny_model_dir, data, out))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=5)
    assert main(args) == 0
    assert "resuming from" in capsys.readouterr().err
    assert_bitwise_equal(load_file(str(out / "adapter" / "adapter_model.safetensors")), reference[0])
    # another config for the same folder: refused with the keys, one line, nothing touched
    before = sorted(str(p) for p in out.rglob("*"))
    assert main(args + ["--lr", "2e-2", "--set", "lora.r=8"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hivetune: error: output_dir: {out} holds a run with another config (lora.r: 4 -> 8; lr: 0.01 -> 0.02); "
        f"choose another output, or resume it as it was with --resume {out}"]
    assert sorted(str(p) for p in out.rglob("*")) == before


def test_cli_resume_uses_the_saved_config_and_refuses_changes(tiny_model_dir, data, reference, tmp_path, capsys):
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=3)
    assert main(["train", "--resume", str(out), "--lr", "5e-3", "--max-steps", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hivetune: error: --resume: a resumed run keeps its config; these flags change it: "
        "lr: 0.01 -> 0.005; max_steps: 6 -> 8"]
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hivetune: error: --resume: {tmp_path / 'nope'} is not a run folder (no config.yaml)")
    # flags equal to the saved config are fine
    assert main(["train", "--resume", str(out), "--lr", "1e-2", "--quiet"]) == 0
    assert_bitwise_equal(load_file(str(out / "adapter" / "adapter_model.safetensors")), reference[0])
    assert [r["step"] for r in metric_rows(out)] == [1, 2, 3, 4, 5, 6]


def test_changed_data_is_refused_on_resume(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", ops_records(24))
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out, max_steps=0, epochs=1.0))  # 6 steps of 4 from 24 examples
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=3)
    write_jsonl(data, ops_records(32))
    with pytest.raises(UserError, match=r"step-000002: written for a plan of 6 steps over 24 examples; the config "
                                        r"now plans 8 steps over 32 examples \(did the data file change, or the step order: batch_order\?\)"):
        setup(run_cfg(tiny_model_dir, data, out, max_steps=0, epochs=1.0))


def test_no_valid_checkpoint_starts_again_at_step_0(tiny_model_dir, data, reference, tmp_path, capsys):
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out, save_every=0))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=1)  # killed before any checkpoint
    capsys.readouterr()
    run = setup(run_cfg(tiny_model_dir, data, out, save_every=0))
    assert capsys.readouterr().err.strip() == (
        f"hivetune: warning: {out} has no valid checkpoint; starting again at step 0")
    assert run.start_step == 0 and (out / "metrics.jsonl").read_text() == ""
    fit(run, progress=False)
    assert_bitwise_equal(lora_state_dict(run.model), reference[0])


# --- non-finite steps -------------------------------------------------------------------------


class _NaNGrad(torch.autograd.Function):
    """Identity forward; NaN gradient backward: a finite loss with poisoned gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


def poison(monkeypatch, bad_steps: set[int], kind: str) -> None:
    """Make the loss (or only the gradients) of the given 1-based steps non-finite."""
    import hivetune.train.loop as train_module

    real = train_module.fused_target_loss_sum
    calls = {"n": 0}

    def loss_fn(hidden, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] in bad_steps:
            hidden = _NaNGrad.apply(hidden) if kind == "grad" else hidden * float("nan")
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(train_module, "fused_target_loss_sum", loss_fn)


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_non_finite_step_is_skipped_and_counted(kind, tiny_model_dir, data, tmp_path, monkeypatch):
    poison(monkeypatch, {3}, kind)
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out, save_every=1, keep_checkpoints=10))
    fit(run, progress=False)
    rows = metric_rows(out)
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert rows[2]["grad_norm"] is None and (rows[2]["loss"] is None) == (kind == "loss")
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in rows[3:])
    weights = {s: load_file(str(out / "checkpoints" / f"step-{s:06d}" / "adapter_model.safetensors")) for s in (2, 3, 4)}
    assert_bitwise_equal(weights[3], weights[2])  # no update at step 3
    assert any(not torch.equal(weights[4][k], weights[3][k]) for k in weights[3])
    assert all(torch.isfinite(t).all() for t in lora_state_dict(run.model).values())
    state = torch.load(out / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=True)
    assert int(state["optimizer"]["state"][0]["step"]) == 5  # Adam stepped 5 times in 6 steps
    assert state["counters"]["skipped_steps"] == 1


def test_too_many_bad_steps_in_a_row_stop_with_one_line(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    poison(monkeypatch, {3, 4, 5, 6}, "loss")
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(out), "--max-steps", "6",
            "--save-every", "2", "--lr", "1e-2", "--precision", "fp32", "--device", "cpu", "--threads", "1",
            "--quiet", "--set", "eval_prompts=0", "--set", "max_bad_steps=3", "--set", "keep_checkpoints=5"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hivetune: error: step 5: loss or gradients not finite in 3 steps in a row (max_bad_steps), so training "
        f"stopped; the last checkpoint, {out / 'checkpoints' / 'step-000004'}, is intact. "
        "Try a lower lr than 0.01 (e.g. --lr 0.0025) in a new run"]
    folders = checkpoint_folders(out / "checkpoints")
    assert [f.name for f in folders] == ["step-000002", "step-000004"]
    assert all(verify_checkpoint(f) == "" for f in folders)
    two, four = (load_file(str(f / "adapter_model.safetensors")) for f in folders)
    assert_bitwise_equal(four, two)  # steps 3 and 4 were skipped: the weights are step 2's, finite
    assert all(torch.isfinite(t).all() for t in four.values())
    assert not (out / "adapter").exists()
    assert [r["skipped_steps"] for r in metric_rows(out)] == [0, 0, 1, 2, 3]


def test_checkpoints_keep_the_cuda_graph_sizes_for_the_resumed_run(tiny_model_dir, data, tmp_path):
    """Each rank's planned graph sizes go into the checkpoint and come back to that rank on
    resume (train.graph_plan.saved_sizes), stay in later checkpoints, and are not given to a run on
    another number of processes. (On the CPU nothing graphs: the sizes are set by hand.)"""
    from types import SimpleNamespace

    from hivetune.parallel.distributed import Dist
    from hivetune.train.graph_plan import saved_sizes

    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out))
    assert saved_sizes(run) is None  # a fresh run plans its own
    run.graph_sizes = {3: [128, 192], 5: [256]}
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=3)
    resumed = setup(run_cfg(tiny_model_dir, data, out))
    assert resumed.start_step == 2
    assert resumed.counters["graph_sizes"] == [{3: [128, 192], 5: [256]}]
    assert saved_sizes(resumed) == {3: [128, 192], 5: [256]}
    fit(resumed, progress=False)
    last = checkpoint_folders(out / "checkpoints")[-1]
    state = torch.load(last / ckpt.STATE, map_location="cpu", weights_only=True)
    assert state["step"] == 6 and state["counters"]["graph_sizes"] == [{3: [128, 192], 5: [256]}]
    two = SimpleNamespace(counters={"graph_sizes": [{3: [128]}, {3: [64]}]}, parallel=Dist(1, 2, 1))
    assert saved_sizes(two) == {3: [64]}
    assert saved_sizes(SimpleNamespace(counters=two.counters, parallel=Dist(0, 4, 0))) is None
