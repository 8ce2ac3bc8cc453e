"""The deferred step ledger (train.StepLedger) against per-step reads, and the fused AdamW skip
that lets the GPU loop run without a host sync per step."""

from __future__ import annotations

import math

import pytest
import torch

from hivetune.train.ledger import StepLedger

FLAGS = [True, False, False, True, False, False, False, True, True]
LOSSES = [1.0, float("nan"), float("inf"), 0.5, float("nan"), 2.0, float("nan"), 0.25, 0.125]


def replay(deferred: bool, flush_every: int):
    ledger = StepLedger(deferred=deferred)
    counters = {"skipped_steps": 0, "bad_in_a_row": 0}
    records, bad_runs, reads = [], [], 0
    for i, (ok, loss) in enumerate(zip(FLAGS, LOSSES)):
        record = {"step": i + 1, "loss": torch.tensor(loss), "grad_norm": torch.tensor(float(i)), "lr": 0.1}
        ledger.add(torch.tensor(ok), record if i % 2 == 0 else None, False)
        if ledger.due((i + 1) % flush_every == 0 or i == len(FLAGS) - 1):
            got, bad, signalled = ledger.read(counters, max_bad_steps=3)
            records += got
            bad_runs.append((i + 1, bad))
            reads += 1
            assert signalled is False
    return records, counters, bad_runs, reads


def test_deferred_reads_give_the_per_step_records_and_counters():
    eager, counters, bad_runs, reads = replay(False, 1)
    assert reads == len(FLAGS)
    assert [r["step"] for r in eager] == [1, 3, 5, 7, 9]
    assert [r["skipped_steps"] for r in eager] == [0, 2, 3, 5, 5]
    assert [r["loss"] for r in eager] == [1.0, None, None, None, 0.125]
    assert [r["grad_norm"] for r in eager] == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert counters == {"skipped_steps": 5, "bad_in_a_row": 0}
    assert [step for step, bad in bad_runs if bad] == [7]  # steps 5-7 are three bad ones in a row
    deferred, counters_d, bad_runs_d, reads_d = replay(True, 4)
    assert reads_d == 3
    assert deferred == eager and counters_d == counters
    assert [step for step, bad in bad_runs_d if bad] == [8]  # seen at the read after step 7


def test_signal_read_from_the_newest_step():
    ledger = StepLedger(deferred=True)
    counters = {"skipped_steps": 0, "bad_in_a_row": 0}
    ledger.add(torch.tensor(True), None, torch.tensor(False))
    ledger.add(torch.tensor(True), None, torch.tensor(True))
    assert ledger.read(counters, 3) == ([], False, True)
    assert ledger.pending == []


def test_deferred_reads_date_records_in_the_window_the_gpu_ran_them():
    """Deferred, the host queues steps ahead of the GPU, so a read re-dates its records: the
    steps since the previous read ran between the two reads, each record placed in that window
    by the tokens done, and its rates counted from the record before it (across reads too).
    Per-step reads keep the host's dates (each step was read, so run, before the next)."""
    times = iter([102.0, 103.0])
    ledger = StepLedger(deferred=True, started=100.0, clock=lambda: next(times))
    counters = {"skipped_steps": 0, "bad_in_a_row": 0}

    def step(n, tokens, logged=True):
        record = {"step": n, "loss": torch.tensor(1.0), "grad_norm": torch.tensor(1.0), "elapsed_s": 0.01 * n,
                  "tokens_per_s": 9e9, "samples_per_s": 9e9} if logged else None
        ledger.add(torch.tensor(True), record, False, tokens, 2)

    for n, tokens in enumerate([100, 300, 100, 500], 1):  # 1,000 tokens, read 2 s after the start
        step(n, tokens)
    first, _, _ = ledger.read(counters, 3)
    assert [r["elapsed_s"] for r in first] == [0.2, 0.8, 1.0, 2.0]
    assert [r["tokens_per_s"] for r in first] == [500.0] * 4
    assert [r["samples_per_s"] for r in first] == [10.0, pytest.approx(3.333), 10.0, 2.0]
    step(5, 250, logged=False)
    step(6, 250, logged=False)
    step(7, 500)  # 1,000 tokens in the next second: 6 samples since step 4's record
    (last,), _, _ = ledger.read(counters, 3)
    assert (last["step"], last["elapsed_s"], last["tokens_per_s"], last["samples_per_s"]) == (7, 3.0, 1000.0, 6.0)
    eager = StepLedger(deferred=False, started=100.0, clock=lambda: 1 / 0)  # never consulted
    eager.add(torch.tensor(True), {"step": 1, "loss": torch.tensor(1.0), "grad_norm": torch.tensor(1.0),
                                   "elapsed_s": 0.5, "tokens_per_s": 7.0, "samples_per_s": 1.0}, False, 100, 2)
    (kept,), _, _ = eager.read(counters, 3)
    assert (kept["elapsed_s"], kept["tokens_per_s"]) == (0.5, 7.0)


def test_fused_adamw_found_inf_leaves_weights_and_moments_as_they_were():
    """What the deferred loop relies on: a found_inf of 1 makes fused AdamW a no-op (weights,
    moments and step count), and a 0 steps exactly as a plain step() does."""
    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5, 3))
        try:
            opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.01, fused=True)
        except RuntimeError as e:
            pytest.skip(f"no fused AdamW on this device: {e}")
        return p, opt

    p, opt = make()
    q, ref = make()
    for k in range(3):
        for param in (p, q):
            param.grad = torch.full_like(param, 0.5 + k)
        opt.found_inf = torch.tensor(0.0)
        opt.step()
        ref.step()
    assert torch.equal(p, q)
    before = (p.detach().clone(), opt.state[p]["exp_avg"].clone(), float(opt.state[p]["step"]))
    p.grad = torch.full_like(p, math.nan)
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert torch.equal(p, before[0]) and torch.equal(opt.state[p]["exp_avg"], before[1])
    assert float(opt.state[p]["step"]) == before[2]


def fused_adamw_loop(monkeypatch, deferred: bool):
    """fit with fused AdamW on the CPU, its steps read per step or deferred (the CUDA loop)."""
    import hivetune.train.loop as train_module
    import hivetune.train.setup as setup_module

    def fused(params, lr, weight_decay, fused):
        return torch.optim.AdamW(list(params), lr=lr, weight_decay=weight_decay, fused=True)

    monkeypatch.setattr(setup_module, "adamw", fused)
    monkeypatch.setattr(train_module, "defer_steps", lambda run: deferred)


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_deferred_loop_equals_the_per_step_loop(kind, tiny_model_dir, tmp_path, monkeypatch):
    """The same poisoned run, deferred and not: the same metrics rows, the same adapter bit for
    bit, the same Adam step count, and the bad step skipped."""
    from safetensors.torch import load_file

    from hivetune.train.loop import fit

    from hivetune.train.setup import setup
    from conftest import ops_records, write_jsonl
    from test_resume import assert_bitwise_equal, metric_rows, poison, run_cfg

    data = write_jsonl(tmp_path / "train.jsonl", ops_records(24))
    out = {}
    for deferred in (False, True):
        with monkeypatch.context() as m:
            fused_adamw_loop(m, deferred)
            poison(m, {3}, kind)
            folder = tmp_path / f"run-{deferred}"
            fit(setup(run_cfg(tiny_model_dir, data, folder, save_every=6)), progress=False)
            state = torch.load(folder / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=True)
            out[deferred] = (metric_rows(folder), load_file(str(folder / "adapter" / "adapter_model.safetensors")),
                             int(state["optimizer"]["state"][0]["step"]), state["counters"]["skipped_steps"])
    rows, rows_d = out[False][0], out[True][0]
    strip = (lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "samples_per_s", "elapsed_s", "peak_memory_bytes")}
                         for r in rs])
    assert strip(rows_d) == strip(rows)
    assert [r["skipped_steps"] for r in rows_d] == [0, 0, 1, 1, 1, 1]
    assert_bitwise_equal(out[True][1], out[False][1])
    assert out[True][2:] == out[False][2:] == (5, 1)


def test_deferred_rollback_starts_at_the_read_that_sees_it(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    """Bad steps 3-5 with max_bad_steps 3: the per-step loop rolls back from step 5; deferred,
    the read after step 6 (a checkpoint step) sees the run and rolls back from there."""
    from test_rollback_oom import ROLLBACK_LOG, bad_steps_3_to_5_with_rollback

    fused_adamw_loop(monkeypatch, True)
    result, log = bad_steps_3_to_5_with_rollback(tiny_model_dir, alpaca_file, tmp_path / "run", monkeypatch)
    assert [(r["step"], r.get("event")) for r in log] == ROLLBACK_LOG
    assert log[4] == {"step": 4, "event": "rollback", "from_step": 6, "lr_scale": 0.5}
    assert [r["skipped_steps"] for r in log if "loss" in r] == [0, 0, 1, 2, 2, 2]
    assert result.steps == 6 and log[6]["loss"] is not None
