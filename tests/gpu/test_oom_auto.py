"""A real CUDA out-of-memory error in training (tests/train/test_rollback_oom.py simulates one on the
CPU): without auto the run stops with one line that names the micro-batch, the planner's advice
and the intact last checkpoint; with auto the step is redone with half the micro-batch and the
run gives the losses of a run that used that micro-batch from the start.

The out-of-memory is the caching allocator's own (torch.cuda.set_per_process_memory_fraction):
a small random model (hidden 1,024, 4 layers, fp32) with 8 examples of 512 tokens a step. Two
calibration runs measure what a step adds to the memory held before it, with micro-batches of
4 and of 8 examples (~0.9 and ~1.7 GB); the cap is set halfway between, above what was held
when it is set, as a fraction of this GPU's memory (torch.cuda.mem_get_info), so 8 examples do
not fit and 4 do on any size of GPU.
"""

from __future__ import annotations

import gc
import hashlib
import json
from pathlib import Path

import pytest
import torch

import hivetune.train.loop as train_module
from hivetune.checkpoint import checkpoint_folders, load_checkpoint, verify_checkpoint
from hivetune.core.config import load_config
from hivetune.core.device import cap_memory
from hivetune.core.errors import UserError
from hivetune.model.lora import lora_state_dict
from hivetune.plan.gpus import device_memory_bytes
from hivetune.train.loop import fit
from hivetune.train.setup import setup

from conftest import CORPUS, build_tiny_model, build_tokenizer, write_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

EXAMPLES, LENGTH, STEPS = 8, 512, 4


@pytest.fixture(scope="module")
def oom_model(tmp_path_factory) -> tuple[Path, Path]:
    """A model folder (tokenizer + fp32 safetensors, ~230 MB) and 40 alpaca records that are
    each cut to exactly LENGTH tokens (long responses, truncated at max_length)."""
    folder = tmp_path_factory.mktemp("oom-model")
    build_tokenizer(folder)
    build_tiny_model(folder, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                     num_key_value_heads=4)
    text = " ".join(CORPUS) * 12  # ~4,000 characters: well over LENGTH tokens
    records = [{"instruction": f"Explain item {i}.", "input": "", "output": f"{i}: {text}"} for i in range(40)]
    return folder, write_jsonl(folder / "train.jsonl", records)


def config(model_and_data, out: Path, **kw):
    folder, data = model_and_data
    values = {"model": str(folder), "data": str(data), "output_dir": str(out), "device": "cuda", "precision": "fp32",
              "lora": {"r": 8, "alpha": 16, "dropout": 0.0},  # no dropout: a failed try draws no random numbers
              "eval_prompts": 0, "batch_size": EXAMPLES, "grad_accum": 1, "max_steps": STEPS, "max_length": LENGTH,
              "lr": 1e-3, "warmup_steps": 0, "log_every": 1, "cuda_graphs": False}
    values.update(kw)
    return load_config(None, values)


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def held_bytes() -> int:
    """Reserved by the caching allocator once its unused cache is returned."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def cap_at(limit: int) -> None:
    """Let this process's allocator reserve at most `limit` bytes."""
    cap_memory(torch.device("cuda", torch.cuda.current_device()), limit / 2**30)


def release(*runs) -> None:
    torch.cuda.set_per_process_memory_fraction(1.0)
    for run in runs:
        run.model = run.module = run.optimizer = None
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def calibration(oom_model, tmp_path_factory):
    """(bytes a step adds with 4 examples a micro-batch, with 8, losses of the 4 x 2 run)."""
    tmp = tmp_path_factory.mktemp("oom-calibration")
    added = {}
    for size in (EXAMPLES // 2, EXAMPLES):
        run = setup(config(oom_model, tmp / f"b{size}", batch_size=size, grad_accum=EXAMPLES // size,
                           max_steps=STEPS if size < EXAMPLES else 2))
        assert set(run.data.lengths) == {LENGTH}
        before = held_bytes()
        before_allocated = torch.cuda.memory_allocated()
        fit(run, progress=False)  # resets the peak statistics when it starts
        added[size] = torch.cuda.max_memory_reserved() - before
        print(f"{size} examples: reserved {before / 2**30:.2f} GiB before, +{added[size] / 2**30:.2f} at the peak; "
              f"allocated {before_allocated / 2**30:.2f} before, "
              f"+{(torch.cuda.max_memory_allocated() - before_allocated) / 2**30:.2f}; "
              f"stats {run.model.activation_offload is not None} {run.cfg.gradient_checkpointing} "
              f"{run.cfg.lora_inputs} {getattr(run.model.lora_casts, 'keep_inputs', None)}")
        release(run)
    print(f"a step adds {added[EXAMPLES // 2] / 2**30:.2f} GiB with {EXAMPLES // 2} examples a micro-batch, "
          f"{added[EXAMPLES] / 2**30:.2f} GiB with {EXAMPLES}")
    assert added[EXAMPLES] > 1.5 * added[EXAMPLES // 2], added  # activations dominate: the sizes separate
    return added[EXAMPLES // 2], added[EXAMPLES], losses(tmp / f"b{EXAMPLES // 2}")


def headroom(calibration) -> int:
    """What a step may add under the cap: halfway between 4 and 8 examples' needs."""
    half, full, _ = calibration
    return (half + full) // 2


def sha256s(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_oom_without_auto_stops_and_the_checkpoint_is_intact(oom_model, calibration, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run = setup(config(oom_model, out, save_every=2))
    saved = {}
    real_save = train_module.save_all_ranks

    def save_then_cap(run_, step, counters):
        """After step 2's checkpoint: note its files and LoRA weights, then cap the memory."""
        real_save(run_, step, counters)
        if step == 2:
            folder = checkpoint_folders(out / "checkpoints")[-1]
            saved.update(folder=folder, files=sha256s(folder),
                         lora={k: v.clone() for k, v in lora_state_dict(run_.model).items()})
            cap_at(held_bytes() + headroom(calibration))

    monkeypatch.setattr(train_module, "save_all_ranks", save_then_cap)
    try:
        with pytest.raises(UserError) as e:
            fit(run, progress=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    message = str(e.value)
    print(message)
    assert "\n" not in message
    assert message.startswith(f"CUDA out of memory with {EXAMPLES} examples ({EXAMPLES * LENGTH} tokens) "
                              f"per micro-batch; the last checkpoint, {saved['folder']}, is intact. ")
    assert "The planner: micro-batches up to " in message and " tokens fit this GPU (" in message
    assert message.endswith(f"try --batch-size {EXAMPLES // 2} --grad-accum 2, or --auto to shrink the "
                            f"micro-batch when this happens")
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2]

    # The checkpoint of step 2 is the newest, byte for byte as written, and loads.
    folder = saved["folder"]
    assert checkpoint_folders(out / "checkpoints") == [folder] and folder.name == "step-000002"
    assert sha256s(folder) == saved["files"]
    assert verify_checkpoint(folder) == ""
    with torch.no_grad():
        for p in run.optimizer.param_groups[0]["params"]:
            p.add_(1.0)  # so that loading has something to undo
    assert load_checkpoint(run, folder)["step"] == 2
    now = lora_state_dict(run.model)
    assert all(torch.equal(now[k], saved["lora"][k]) for k in saved["lora"])
    release(run)


def test_oom_with_auto_halves_the_micro_batch_and_keeps_the_curve(oom_model, calibration, tmp_path, capsys):
    out = tmp_path / "auto"
    run = setup(config(oom_model, out, auto=True, save_every=STEPS))
    cap_at(held_bytes() + headroom(calibration))  # the first step's 8 examples do not fit
    try:
        result = fit(run, progress=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    err = capsys.readouterr().err
    assert (f"CUDA out of memory with {EXAMPLES} examples ({EXAMPLES * LENGTH} tokens) per micro-batch; "
            f"retrying the step with {EXAMPLES // 2}") in err
    assert err.count("CUDA out of memory") == 1  # 4 examples fit: no second retry
    assert result.steps == STEPS
    state = torch.load(out / "checkpoints" / f"step-{STEPS:06d}" / "trainer_state.pt", weights_only=True)
    assert state["counters"]["micro_batch"] == EXAMPLES // 2  # and a resume keeps it
    got, want = losses(out), calibration[2]
    print(f"auto {got}\n4 x 2 {want}\nbitwise equal: {got == want}")
    # fp32 and the same micro-batches from step 1 on: equal but for kernels that accumulate with
    # atomics (SDPA's memory-efficient backward); a lost or doubled micro-batch is off by ~50%.
    assert got == pytest.approx(want, rel=1e-5)
    release(run)


def test_device_memory_bytes_reads_the_cap_and_what_is_free():
    """plan.gpus.device_memory_bytes (lora_inputs auto's room): the device's memory times the
    per-process fraction (bench --memory-cap), never more than is free plus what this process
    holds; a 1 GiB block held elsewhere in the process still counts as this process's."""
    device = torch.device("cuda", torch.cuda.current_device())
    index = device.index
    free, total = torch.cuda.mem_get_info(index)
    whole = device_memory_bytes(device)
    assert whole <= free + torch.cuda.memory_reserved(index) and whole > 0.5 * free
    block = torch.empty(2**29, dtype=torch.bfloat16, device=device)  # 1 GiB: reserved by this process
    assert abs(device_memory_bytes(device) - whole) < 2**27
    del block
    torch.cuda.set_per_process_memory_fraction(0.25, index)
    try:
        room = free + torch.cuda.memory_reserved(index)
        assert device_memory_bytes(device) == int(min(total * 0.25, room))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
