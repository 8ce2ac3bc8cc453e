"""Two GPUs through torchrun + NCCL (DDP and FSDP2) give the one-GPU run of the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import kill_torchrun_train_after

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")

FLAGS = ["--precision", "fp32", "--device", "cuda", "--max-steps", "6", "--lr", "5e-3", "--set", "lora.r=4",
         "--set", "lora.alpha=8", "--set", "lora.dropout=0", "--set", "eval_prompts=0", "--set", "warmup_steps=0",
         "--set", "cuda_graphs=false", "--quiet"]


def train_cli(args, nproc, **extra_env):
    env = {**os.environ, **extra_env}
    env.pop("WORLD_SIZE", None)
    extra = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    proc = subprocess.run([sys.executable, "-m", "hivetune", "train", *extra, *args], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(folder):
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpus_match_one_gpu(strategy, tiny_model_dir, alpaca_file, tmp_path):
    common = ["--model", str(tiny_model_dir), "--data", str(alpaca_file), *FLAGS]
    train_cli([*common, "--output", str(tmp_path / "one"), "--batch-size", "4", "--grad-accum", "2"], 1)
    train_cli([*common, "--output", str(tmp_path / "two"), "--batch-size", "4", "--grad-accum", "1",
               "--set", f"distributed={strategy}"], 2)
    # fp32 on GPUs: TF32 is off by default in torch; sums over ranks in another order than one
    # process adds them, so the tolerance is fp32 rounding, not bitwise.
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    a = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_ddp_with_cuda_graphs_tracks_one_gpu(tiny_model_dir, alpaca_file, tmp_path):
    # bf16 with CUDA graphs on: each rank replays its graphs, the LoRA gradients are all-reduced
    # after the step; the loss curve follows one GPU's with the same global batch.
    flags = [f for f in FLAGS]
    flags[flags.index("fp32")] = "bf16"
    flags[flags.index("cuda_graphs=false")] = "cuda_graphs=true"
    common = ["--model", str(tiny_model_dir), "--data", str(alpaca_file), *flags]
    train_cli([*common, "--output", str(tmp_path / "one"), "--batch-size", "4", "--grad-accum", "2"], 1)
    proc = train_cli([*common, "--output", str(tmp_path / "two"), "--batch-size", "4", "--grad-accum", "1",
                      "--set", "distributed=ddp", "--set", "save_every=6"], 2)
    assert "CUDA graphs off" not in proc.stderr, proc.stderr[-2000:]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=2e-2)
    # Both ranks planned the same graph sizes (paced counts, one capture cost agreed across
    # ranks): a step's all-reduce waits for the larger graph, so differing sizes only cost time.
    last = sorted((tmp_path / "two" / "checkpoints").glob("step-*"))[-1]
    sizes = torch.load(last / "trainer_state.pt", map_location="cpu", weights_only=True)["counters"]["graph_sizes"]
    assert len(sizes) == 2 and sizes[0] == sizes[1] and sizes[0], sizes


@pytest.mark.parametrize("setting", [["distributed=ddp"], ["distributed=fsdp"], ["distributed=ddp", "base_quant=nf4"]],
                         ids=["ddp", "fsdp", "ddp-nf4"])
def test_two_gpu_run_killed_and_resumed_is_bitwise(setting, tiny_model_dir, alpaca_file, tmp_path):
    # The shipped defaults (bf16, CUDA graphs where the strategy allows, dropout 0.05): a 2-process
    # run whose command is killed (SIGKILL) after its step-4 checkpoint, resumed on 2 processes,
    # ends with the uninterrupted run's adapter, bit for bit.
    sets = [a for s in setting for a in ("--set", s)]
    common = ["--model", str(tiny_model_dir), "--data", str(alpaca_file), "--device", "cuda", "--max-steps", "10",
              "--batch-size", "4", "--save-every", "2", "--set", "eval_prompts=0", "--quiet", *sets]
    train_cli([*common, "--output", str(tmp_path / "whole")], 2)
    whole = load_file(str(tmp_path / "whole" / "adapter" / "adapter_model.safetensors"))

    run = tmp_path / "killed"
    env = {**os.environ, "HIVETUNE_TEST_SLOW_CHECKPOINT": "0.4"}  # each checkpoint write takes ~1 s
    env.pop("WORLD_SIZE", None)
    last = kill_torchrun_train_after(common, run, 4, env)
    assert 4 <= last < 10, last

    train_cli(["--resume", str(run), "--quiet"], 2)
    resumed = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert resumed.keys() == whole.keys()
    diff = max(float((resumed[k].float() - whole[k].float()).abs().max()) for k in whole)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole), f"resumed from step {last}: max diff {diff:.3g}"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == \
        [json.loads(line)["step"] for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
