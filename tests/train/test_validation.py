"""Validation during training: val_split, validation loss in metrics.jsonl, early stopping."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from hivetune.core.config import load_config
from hivetune.data.batch import collate_padded
from hivetune.core.errors import UserError
from hivetune.ops.loss import target_loss_sum
from hivetune.train.loop import fit, validation_loss
from hivetune.checkpoint import plan_hash
from hivetune.data.step_plan import StepPlan
from hivetune.data.step_plan import data_plan, split_validation
from hivetune.train.setup import setup

from conftest import tiny_config


def metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_split_validation_is_seeded_disjoint_and_complete():
    train_ids, val_ids = split_validation(100, 0.05, seed=3)
    assert len(val_ids) == 5 and len(train_ids) == 95
    assert sorted(train_ids + val_ids) == list(range(100))
    assert split_validation(100, 0.05, seed=3) == (train_ids, val_ids)
    assert split_validation(100, 0.05, seed=4)[1] != val_ids
    assert tuple(map(list, split_validation(10, 0.0, seed=0))) == (list(range(10)), [])
    assert split_validation(10, 0.01, seed=0)[1].__len__() == 1  # at least one
    with pytest.raises(UserError, match=r"val_split: 0.95 of 2 examples leaves none to train on"):
        split_validation(2, 0.95, seed=0)


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


# (examples, fraction, seed) -> sha256 of [train ids, validation ids] as split_validation drew
# them in lists of Python ints
SPLITS = [((1000, 0.1, 3), "544a176569ad20eaa7a06d35c43323b7e6d00593a35f9c242478ecbbb253e727"),
          ((37, 0.05, 0), "4e8fe67e1526487823fe65a3b0bd5ac988be9417d0f6e5cc4eac6fadf8f212c3"),
          ((50000, 0.02, 8), "74a741d5d8e55506370ffb04a9ea2919594329ba3ff5145484c294cee1bc9aa4")]


@pytest.mark.parametrize("args,expected", SPLITS)
def test_split_validation_is_pinned_to_its_digest(args, expected):
    train_ids, val_ids = split_validation(*args)
    assert train_ids.itemsize == val_ids.itemsize == 4  # typed arrays of int32
    assert digest([list(train_ids), list(val_ids)]) == expected


class Lengths:
    """A dataset as the data plan sees it: its examples' lengths."""

    def __init__(self, n: int, k: int):
        self.lengths = [(i * 7919 + k * 104729) % 97 * 11 % 1013 + 1 for i in range(n)]

    def __len__(self) -> int:
        return len(self.lengths)


# (examples, per step, epochs, max_steps, seed, val_split, order) -> (steps, training examples,
# plan_hash of the steps as dataset ids, the validation ids' digest's first 16 hex digits)
DATA_PLANS = [
    ((500, 8, 2.0, 0, 3, 0.1, "balanced"), 112, 450,
     "85796ecb095c30ff9fe4837a9758709c4911abe8111d826b600e18fe79f5b1cb", "c01b73f595ed549f"),
    ((500, 8, 2.0, 0, 3, 0.0, "balanced"), 125, 500,
     "d7a3d0f165fb715f0677cd0ea0d583c7c98e4beea9fb87194a43127d029c1019", "4f53cda18c2baa0c"),
    ((123, 4, 1.5, 0, 1, 0.05, "random"), 43, 117,
     "0d7be5a625090bc42574d9ab333cece8277e0a610bf755ea71dda95a0af35fc4", "f058c293dda52a2e"),
    ((3000, 16, 1.0, 50, 2, 0.2, "balanced"), 50, 2400,
     "db66480c9ef821dddae3a3151f164bd3f0fe8e02dd60afe3fa2bc260ed0698e8", "9b930b1380f7363e"),
]


@pytest.mark.parametrize("config,n_steps,n_train,plan_digest,val_digest", DATA_PLANS)
def test_data_plan_is_pinned_to_its_digest(config, n_steps, n_train, plan_digest, val_digest):
    n, per_step, epochs, max_steps, seed, val_split, order = config
    steps, train_examples, val_ids = data_plan(Lengths(n, seed), per_step, epochs, max_steps, seed, val_split, order)
    assert isinstance(steps, StepPlan) and len(steps) == n_steps and train_examples == n_train
    assert plan_hash(steps) == plan_digest
    assert digest(list(val_ids))[:16] == val_digest
    assert not {i for step in steps for i in step} & set(val_ids)


def test_val_split_steps_never_draw_validation_examples(tiny_model_dir, alpaca_file, tmp_path):
    run = setup(tiny_config(tiny_model_dir, alpaca_file, tmp_path / "run", val_split=0.25, max_steps=0, epochs=3))
    data, val_ids = run.val
    assert len(val_ids) == 6 and run.train_examples == 18
    drawn = {i for step in run.steps for i in step}
    assert drawn.isdisjoint(val_ids) and len(drawn) == 18
    assert len(run.steps) == 3 * 18 // 4


def test_validation_loss_equals_padded_reference(tiny_model_dir, alpaca_file, tmp_path):
    run = setup(tiny_config(tiny_model_dir, alpaca_file, tmp_path / "run", val_split=0.25))
    data, ids = run.val
    loss, n = validation_loss(run)
    batch = collate_padded([data.example(i) for i in ids], run.pad_id)
    run.model.eval()
    with torch.no_grad():
        hidden = run.model(batch.input_ids, batch.position_ids, batch.layout)
        ref = target_loss_sum(hidden, run.model.lm_head.weight, batch.target_index, batch.target_ids)
    assert n == sum(data.n_targets[i] for i in ids)
    assert loss == pytest.approx(float(ref) / n, rel=1e-5)
    run.model.train()
    validation_loss(run)
    assert run.model.training


def test_eval_every_writes_validation_records(tiny_model_dir, alpaca_file, tmp_path):
    out = tmp_path / "run"
    result = fit(setup(tiny_config(tiny_model_dir, alpaca_file, out, val_split=0.25, max_steps=5, eval_every=2)),
                 progress=False)
    val = [r for r in metrics(out) if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4, 5]
    assert [r["best_val_loss"] for r in val] == [min(v["val_loss"] for v in val[:k + 1]) for k in range(3)]
    assert result.best_val_loss == pytest.approx(min(r["val_loss"] for r in val), abs=1e-6)
    assert not result.stopped_early and result.steps == 5


def test_early_stopping_keeps_the_best_adapter(tiny_model_dir, alpaca_file, tmp_path):
    # lr 30 without clipping makes the validation loss bounce: it fails to improve twice in a row
    # within a few steps, so the run stops there and keeps the best evaluation's adapter.
    out = tmp_path / "run"
    cfg = tiny_config(tiny_model_dir, alpaca_file, out, val_split=0.25, max_steps=40, eval_every=1,
                      early_stopping_patience=2, lr=30.0, max_grad_norm=0.0)
    result = fit(setup(cfg), progress=False)
    val = [r for r in metrics(out) if "val_loss" in r]
    best, since, expected_stop = None, 0, None
    for r in val:  # the rule, replayed on the recorded curve
        if best is None or r["val_loss"] < best["val_loss"]:
            best, since = r, 0
        else:
            since += 1
        if since == 2:
            expected_stop = r["step"]
            break
    assert expected_stop is not None and expected_stop < 40
    assert result.stopped_early and result.steps == expected_stop == val[-1]["step"]
    assert result.best_val_loss == pytest.approx(best["val_loss"], abs=1e-6)
    assert max(r["step"] for r in metrics(out)) == expected_stop
    final = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    kept = load_file(str(out / "best_adapter" / "adapter_model.safetensors"))
    assert final.keys() == kept.keys() and all(torch.equal(final[k], kept[k]) for k in final)
    # and the final adapter really scores the best validation loss
    run = setup(tiny_config(tiny_model_dir, alpaca_file, tmp_path / "check", val_split=0.25))
    from hivetune.checkpoint import load_lora_weights
    load_lora_weights(run.model, out / "adapter")
    assert validation_loss(run)[0] == pytest.approx(best["val_loss"], abs=1e-5)


def test_validation_config_errors(tiny_model_dir, alpaca_file, tmp_path):
    with pytest.raises(UserError, match="val_split: give either val_split or val_data, not both"):
        tiny_config(tiny_model_dir, alpaca_file, tmp_path / "r", val_split=0.1, val_data=str(alpaca_file))
    with pytest.raises(UserError, match=r"early_stopping_patience: needs a validation set \(val_split or val_data\)"):
        tiny_config(tiny_model_dir, alpaca_file, tmp_path / "r", early_stopping_patience=2)
    with pytest.raises(UserError, match=r"val_split: must be in \[0, 1\), got 1.5"):
        load_config(None, {"data": "x.jsonl", "val_split": 1.5})


def test_fit_writes_tensorboard_scalars_with_validation(tiny_model_dir, alpaca_file, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    fit(setup(tiny_config(tiny_model_dir, alpaca_file, out, val_split=0.25, max_steps=3, eval_every=2,
                          tensorboard=True)), progress=False)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    log = metrics(out)
    train_loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in train_loss] == [1, 2, 3]
    assert [v for _, v in train_loss] == pytest.approx([r["loss"] for r in log if "loss" in r], rel=1e-6)
    # TensorBoard keeps float32: compare to its precision (rounding both sides to 5 decimals
    # failed when a value sat on a rounding boundary: 5.728025 as 5.72802 against 5.72803)
    val = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    tb = [(e.step, e.value) for e in events.Scalars("val/loss")]
    assert [s for s, _ in tb] == [s for s, _ in val] == [2, 3]
    assert [v for _, v in tb] == pytest.approx([v for _, v in val], rel=1e-6)
