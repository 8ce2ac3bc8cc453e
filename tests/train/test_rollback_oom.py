"""Non-finite steps roll back to the last checkpoint with a lower lr; CUDA OOM shrinks the
micro-batch (auto) or stops with the planner's way out."""

import json

import pytest
import torch

import hivetune.train.loop as train_module
from hivetune.checkpoint import checkpoint_folders
from hivetune.core.errors import UserError
from hivetune.train.loop import fit
from hivetune.train.setup import setup

from test_resume import poison
from conftest import tiny_config


def rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


ROLLBACK_LOG = [(1, None), (2, None), (3, None), (4, None), (4, "rollback"), (5, None), (6, None)]


def bad_steps_3_to_5_with_rollback(tiny_model_dir, alpaca_file, out, monkeypatch):
    """6 steps, checkpoints every 2, steps 3-5 non-finite, rollback after 3 in a row at half the
    lr: (fit's result, the metrics rows)."""
    poison(monkeypatch, {3, 4, 5}, "loss")  # forward calls 3-5: steps 3, 4, 5 (one micro-batch each)
    cfg = tiny_config(tiny_model_dir, alpaca_file, out, max_steps=6, save_every=2, max_bad_steps=3,
                      on_bad_steps="rollback", rollback_lr_factor=0.5, lr=1e-2, schedule="constant",
                      keep_checkpoints=5)
    result = fit(setup(cfg), progress=False)
    return result, rows(out)


def test_rollback_to_last_checkpoint_with_lower_lr(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    out = tmp_path / "run"
    result, log = bad_steps_3_to_5_with_rollback(tiny_model_dir, alpaca_file, out, monkeypatch)
    # steps 1-2 good, 3-5 bad: back to the checkpoint of step 4, then 5 and 6 again at half the lr
    assert [(r["step"], r.get("event")) for r in log] == ROLLBACK_LOG
    assert log[4] == {"step": 4, "event": "rollback", "from_step": 5, "lr_scale": 0.5}
    assert [r["lr"] for r in log if "lr" in r] == pytest.approx([1e-2] * 4 + [5e-3] * 2)
    assert log[5]["loss"] is not None and log[6]["loss"] is not None
    assert result.steps == 6 and result.final_loss == pytest.approx(log[6]["loss"])
    state = torch.load(out / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=True)
    assert state["scheduler"]["base_lrs"] == pytest.approx([5e-3])  # a resume keeps the lower lr
    assert state["counters"]["rollbacks"] == 1


def test_rollbacks_exhausted_stop_with_a_message(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    poison(monkeypatch, set(range(3, 100)), "loss")
    out = tmp_path / "run"
    cfg = tiny_config(tiny_model_dir, alpaca_file, out, max_steps=8, save_every=2, max_bad_steps=2,
                      on_bad_steps="rollback", max_rollbacks=2, lr=1e-2, keep_checkpoints=5)
    with pytest.raises(UserError) as e:
        fit(setup(cfg), progress=False)
    last = checkpoint_folders(out / "checkpoints")[-1]
    assert str(e.value) == (
        f"step 4: loss or gradients not finite in 2 steps in a row (max_bad_steps), so training stopped; "
        f"the last checkpoint, {last}, is intact. Try a lower lr than 0.01 (e.g. --lr 0.0025) in a new run "
        f"(after 2 rollbacks, max_rollbacks)")
    assert [r["from_step"] for r in rows(out) if r.get("event") == "rollback"] == [4, 4]


def fake_oom_above(monkeypatch, limit: int, sizes: list):
    """Micro-batches of more than `limit` examples raise CUDA's out-of-memory error."""
    real = train_module.micro_step_fn

    def micro_step_fn(run, loss_fn):
        step = real(run, loss_fn)

        def guarded(batch, n_targets):
            n = len(batch.layout.lengths) if hasattr(batch.layout, "lengths") else batch.input_ids.shape[0]
            sizes.append(n)
            if n > limit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return step(batch, n_targets)
        return guarded

    monkeypatch.setattr(train_module, "micro_step_fn", micro_step_fn)


def test_auto_halves_the_micro_batch_on_oom_and_keeps_the_curve(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    fit(setup(tiny_config(tiny_model_dir, alpaca_file, ref, batch_size=2, grad_accum=4, max_steps=3)), progress=False)
    sizes = []
    fake_oom_above(monkeypatch, 2, sizes)
    out = tmp_path / "auto"
    result = fit(setup(tiny_config(tiny_model_dir, alpaca_file, out, batch_size=8, max_steps=3, auto=True,
                                   save_every=3)), progress=False)
    assert sizes[:3] == [8, 4, 2]  # 8 fails, 4 fails, 2 fits: then 2 for every micro-batch
    assert set(sizes[2:]) == {2} and len(sizes) == 2 + 3 * 4
    got, want = rows(out), rows(ref)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-6)
    assert result.steps == 3
    state = torch.load(out / "checkpoints" / "step-000003" / "trainer_state.pt", weights_only=True)
    assert state["counters"]["micro_batch"] == 2  # a resume keeps the size that fits


def test_oom_without_auto_stops_with_the_way_out(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    fake_oom_above(monkeypatch, 2, [])
    out = tmp_path / "run"
    with pytest.raises(UserError) as e:
        fit(setup(tiny_config(tiny_model_dir, alpaca_file, out, batch_size=8, max_steps=3)), progress=False)
    assert str(e.value).startswith("CUDA out of memory with 8 examples (")
    assert str(e.value).endswith("tokens) per micro-batch; no checkpoint was written yet. `hivetune plan` "
                                 "predicts what fits; try --batch-size 4 --grad-accum 2, or --auto to shrink "
                                 "the micro-batch when this happens")


def test_oom_after_auto_kept_the_lora_inputs_names_recompute_first(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    """Where lora_inputs auto kept the LoRA groups' dropped inputs (the GPU looked roomy), the
    out-of-memory message names recomputing them first, with what that frees."""
    fake_oom_above(monkeypatch, 2, [])
    run = setup(tiny_config(tiny_model_dir, alpaca_file, tmp_path / "run", batch_size=8, max_steps=3))
    assert run.model.lora_casts.kept_by_auto_bytes == 0  # the CPU: nothing kept
    run.model.lora_casts.kept_by_auto_bytes = 3 * 2**30
    with pytest.raises(UserError) as e:
        fit(run, progress=False)
    assert str(e.value).endswith("try --set lora_inputs=recompute (frees ~3.00 GiB of LoRA inputs kept for "
                                 "backward), --batch-size 4 --grad-accum 2, or --auto to shrink the micro-batch "
                                 "when this happens")


def test_scaled_offload_backs_off_on_oom_and_redoes_the_step(tmp_path, alpaca_file, monkeypatch, capsys):
    """A step whose micro-batch offloaded fewer layers than activation_offload's N (a smaller
    micro-batch than the largest) and still ran out of memory is redone with a 5% smaller budget,
    more layers offloaded: the same losses and weights to 1e-6. One that offloaded N stops with
    the out-of-memory error. (The offload in its CPU test mode: the same hooks, CPU tensors as
    the host copies.)"""
    from conftest import build_tiny_model, build_tokenizer
    from hivetune.model.lora import lora_state_dict
    from hivetune.ops.offload import ActivationOffload

    model_dir = tmp_path / "model"
    build_tokenizer(model_dir)
    build_tiny_model(model_dir, num_hidden_layers=6)

    def run_with_offload(out, fail_when):
        run = setup(tiny_config(model_dir, alpaca_file, out, batch_size=2, max_steps=3))
        offload = run.model.activation_offload = ActivationOffload(run.model, 2, threshold=0, cpu_test=True)
        offload.max_tokens = 10_000  # the budget holds every micro-batch here with nothing moved
        real = train_module.micro_step_fn
        attempts = []

        def micro_step_fn(r, loss_fn):
            step = real(r, loss_fn)

            def guarded(batch, n_targets):
                loss = step(batch, n_targets)  # forward and backward ran: gradients accumulated
                attempts.append(offload.last_layers)
                if fail_when(offload.last_layers, len(attempts)):
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                return loss
            return guarded

        monkeypatch.setattr(train_module, "micro_step_fn", micro_step_fn)
        return run, offload, attempts

    run, offload, _ = run_with_offload(tmp_path / "ref", lambda layers, k: False)
    fit(run, progress=False)
    want, want_rows = lora_state_dict(run.model), rows(tmp_path / "ref")
    assert offload.stats["layers"] == 0

    # micro-batches of 128, 140 and 140 tokens; 6 layers, N = 2 (4 resident), budget 4 x 190 tokens:
    # 1 layer moved (5 resident) for 140 tokens until the budget falls below 700 (0.95^2 x 760)
    run, offload, attempts = run_with_offload(tmp_path / "oom", lambda layers, k: k in (2, 3))
    offload.max_tokens = 190
    fit(run, progress=False)
    assert attempts == [1, 1, 1, 2, 2]  # step 2 failed twice with 1 layer, then ran with 2
    assert offload.stats["back_offs"] == 2 and offload.share == pytest.approx(0.95 ** 2)
    err = capsys.readouterr().err
    assert ("hivetune: CUDA out of memory at step 2 with 1 of activation_offload's 2 layers offloaded (fewer for "
            "a smaller micro-batch); redoing the step with 90% of that budget") in err
    assert [r["loss"] for r in rows(tmp_path / "oom")] == pytest.approx([r["loss"] for r in want_rows], abs=1e-6)
    for key, value in lora_state_dict(run.model).items():
        assert torch.allclose(value, want[key], atol=1e-6), key

    run, offload, _ = run_with_offload(tmp_path / "full", lambda layers, k: True)
    offload.share = 0.0  # every micro-batch offloads N: nothing more to move, so the error stands
    with pytest.raises(UserError, match="^CUDA out of memory with 2 examples"):
        fit(run, progress=False)
    assert offload.stats["back_offs"] == 0
