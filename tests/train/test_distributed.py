"""Several processes (torchrun, gloo on the CPU) give the one-process run of the same global batch."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from hivetune.data import shares
from hivetune.data.shares import balanced_shares
from hivetune.parallel.distributed import Dist, torchrun_argv
from hivetune.core.errors import UserError
from hivetune.train.setup import setup
from hivetune.workflows.train_job import train

from conftest import kill_torchrun_train_after, tiny_config

FLAGS = ["--precision", "fp32", "--device", "cpu", "--threads", "1", "--max-steps", "4", "--lr", "1e-2",
         "--set", "lora.r=4", "--set", "lora.alpha=8", "--set", "lora.dropout=0", "--set", "eval_prompts=0",
         "--set", "warmup_steps=0", "--val-split", "0.25", "--eval-every", "2", "--save-every", "2", "--quiet"]


def rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_shard_and_torchrun_argv():
    ids = list(range(10))
    assert Dist(0, 2).shard(ids) == [0, 2, 4, 6, 8] and Dist(1, 2).shard(ids) == [1, 3, 5, 7, 9]
    assert Dist().shard(ids) == ids
    # with lengths: equal counts, balanced tokens, each rank's share in the step's order
    lengths = {i: n for i, n in enumerate([400, 10, 20, 390, 30, 40, 35, 5, 300, 100])}
    a, b = Dist(0, 2).shard(ids, lengths), Dist(1, 2).shard(ids, lengths)
    assert sorted(a + b) == ids and len(a) == len(b) == 5 and a == sorted(a) and b == sorted(b)
    # two of 400 / 390 / 300 share a rank, with the 3 shortest: 725 is the best split of 5 + 5
    assert max(sum(lengths[i] for i in a), sum(lengths[i] for i in b)) == 725
    assert sorted(sum((Dist(r, 3).shard(ids, lengths) for r in range(3)), [])) == ids
    # W2-like steps (16 examples on 2 GPUs): the token sums differ by under 1%
    rng = random.Random(0)
    for _ in range(20):
        lens = [rng.randint(16, 96) + int(min(400, max(8, rng.lognormvariate(4.8, 0.6)))) for _ in range(16)]
        sums = [sum(lens[k] for k in share) for share in balanced_shares(lens, 2)]
        assert abs(sums[0] - sums[1]) <= 0.01 * sum(lens), sums
    argv = torchrun_argv(2, ["train", "--nproc-per-node", "2", "--data", "x.jsonl", "--nproc-per-node=3"])
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "-m", "hivetune", "train", "--data", "x.jsonl"]


def test_balanced_shares_are_remembered_but_fresh_each_call():
    """balanced_shares remembers a split by its arguments (the graphs' plan and the loop split the
    same steps again) and hands out new lists each time: a caller that edits its copy changes no
    later answer; another world size is another split."""
    lens = [300, 120, 95, 410, 60, 220, 180, 75]
    shares._balanced_shares.cache_clear()
    first = balanced_shares(lens, 2)
    assert sorted(first[0] + first[1]) == list(range(8))
    first[0].append(99)
    first[1].clear()
    again = balanced_shares(lens, 2)
    assert again != first and sorted(again[0] + again[1]) == list(range(8))
    assert shares._balanced_shares.cache_info().hits == 1
    shares._balanced_shares.cache_clear()
    assert balanced_shares(lens, 2) == again  # computed anew: the same split


def test_two_gloo_processes_match_one_process(tiny_model_dir, alpaca_file, tmp_path):
    # One process: 4 examples per micro-batch x 2 micro-batches = 8 per step.
    one = tmp_path / "one"
    cfg = tiny_config(tiny_model_dir, alpaca_file, one, max_steps=4, batch_size=4, grad_accum=2, lr=1e-2,
                      val_split=0.25, eval_every=2, save_every=2)
    train(cfg, progress=False)
    # Two processes: 4 examples each x 1 micro-batch = the same 8 per step.
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "hivetune", "train", "--nproc-per-node", "2",
                           "--model", str(tiny_model_dir), "--data", str(alpaca_file), "--output", str(two),
                           "--batch-size", "4", "--grad-accum", "1", *FLAGS],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("trained 4 steps") == 1  # rank 0 alone prints
    a, b = rows(one), rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 2, 3, 4, 4]
    for ra, rb in zip(a, b):
        key = "val_loss" if "val_loss" in ra else "loss"
        assert rb[key] == pytest.approx(ra[key], abs=1e-6), (ra, rb)
        assert ra.get("epoch") == rb.get("epoch")
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]  # in fact the same floats
    wa = load_file(str(one / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    # One process cuts each step into the token-balanced shares two ranks take (train.micro_parts),
    # and sums their two gradients as the all-reduce does: the same adapter, bit for bit. (With
    # consecutive micro-batches it differed by 1.2e-6 in random order and 3.3e-5 in balanced order,
    # Adam's 1/sqrt(v) magnifying fp32 rounding on near-zero gradients.)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    state = torch.load(two / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=True)
    assert state["counters"]["world"] == 2 and len(state["counters"]["rank_rng"]) == 2

    # The 2-process checkpoint resumed by one process with the same config: the global batch
    # would change, so it is refused with the way out.
    cfg2 = tiny_config(tiny_model_dir, alpaca_file, two, max_steps=4, batch_size=4, grad_accum=1, lr=1e-2,
                       val_split=0.25, eval_every=2, save_every=2)
    with pytest.raises(UserError, match=r"written by 2 processes .*this run has 1: resume with --nproc-per-node 2"):
        setup(cfg2)


def torchrun_train(args, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "hivetune", "train", "--nproc-per-node", "2", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_fsdp2_two_processes_checkpoint_and_resume(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    # FSDP2 shards base and LoRA over 2 gloo processes; same global batch as one process.
    # FSDP keeps q/k/v and gate/up apart (layer by layer LoRA) and steps torch's foreach AdamW:
    # so does the one-process reference.
    monkeypatch.setenv("HIVETUNE_REFERENCE", "fused_lora,fused_adamw")
    one = tmp_path / "one"
    train(tiny_config(tiny_model_dir, alpaca_file, one, max_steps=4, batch_size=4, grad_accum=2, lr=1e-2,
                      val_split=0.25, eval_every=2, save_every=2), progress=False)
    run = tmp_path / "fsdp"
    common = ["--model", str(tiny_model_dir), "--data", str(alpaca_file), "--batch-size", "4", "--grad-accum", "1",
              *FLAGS, "--set", "distributed=fsdp"]
    torchrun_train([*common, "--output", str(run)])
    a, b = rows(one), rows(run)
    for ra, rb in zip(a, b):
        key = "val_loss" if "val_loss" in ra else "loss"
        assert rb[key] == pytest.approx(ra[key], abs=1e-6), (ra, rb)
    final = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    ref = load_file(str(one / "adapter" / "adapter_model.safetensors"))
    # The one process's micro-batches are the ranks' shares (train.micro_parts) and both step the
    # same AdamW: the same adapter, bit for bit. (With the fused AdamW in the reference it differed
    # by up to 4.8e-5, Adam's 1/sqrt(v) magnifying the two implementations' fp32 rounding on
    # near-zero gradients.)
    assert all(torch.equal(final[k], ref[k]) for k in ref)

    # Crash after step 2: drop what came later, resume on 2 processes, get the same adapter.
    import shutil
    shutil.rmtree(run / "checkpoints" / "step-000004")
    shutil.rmtree(run / "adapter")
    (run / "summary.json").unlink()
    torchrun_train(["--resume", str(run), "--quiet"])
    resumed = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    assert [r["step"] for r in rows(run)] == [1, 2, 2, 3, 4, 4]


def test_fsdp2_with_checkpointed_layers_matches_one_process(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    # ops.recompute under FSDP2: a checkpointed layer's recompute in backward runs the sharded
    # layer's forward again (its parameters gathered by FSDP's hooks); the same losses and adapter
    # as one process with checkpointing, as without it.
    monkeypatch.setenv("HIVETUNE_REFERENCE", "fused_lora,fused_adamw")
    one = tmp_path / "one"
    train(tiny_config(tiny_model_dir, alpaca_file, one, max_steps=4, batch_size=4, grad_accum=2, lr=1e-2,
                      val_split=0.25, eval_every=2, save_every=2, gradient_checkpointing=True), progress=False)
    run = tmp_path / "fsdp"
    torchrun_train(["--model", str(tiny_model_dir), "--data", str(alpaca_file), "--batch-size", "4", "--grad-accum",
                    "1", *FLAGS, "--set", "distributed=fsdp", "--gradient-checkpointing", "--output", str(run)])
    for ra, rb in zip(rows(one), rows(run)):
        key = "val_loss" if "val_loss" in ra else "loss"
        assert rb[key] == pytest.approx(ra[key], abs=1e-6), (ra, rb)
    final = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    ref = load_file(str(one / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(final[k], ref[k]) for k in ref)


def test_killed_two_process_run_leaves_no_worker_and_resumes_bitwise(tiny_model_dir, alpaca_file, tmp_path):
    # SIGKILL to `hivetune train --nproc-per-node 2` (torchrun starts its workers in sessions of
    # their own): torchrun and both workers die with it, the run lock is free, and the resumed
    # run ends with the uninterrupted run's adapter, bit for bit (LoRA dropout on).
    flags = ["--model", str(tiny_model_dir), "--data", str(alpaca_file), "--precision", "fp32", "--device", "cpu",
             "--threads", "1", "--max-steps", "6", "--batch-size", "4", "--save-every", "2", "--lr", "1e-2",
             "--set", "lora.r=4", "--set", "lora.dropout=0.1", "--set", "eval_prompts=0", "--quiet"]
    whole = tmp_path / "whole"
    torchrun_train([*flags, "--output", str(whole)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HIVETUNE_TEST_SLOW_CHECKPOINT": "0.5"}
    env.pop("WORLD_SIZE", None)
    run = tmp_path / "killed"
    last = kill_torchrun_train_after(flags, run, 2, env)
    assert last in (2, 4), last
    torchrun_train(["--resume", str(run), "--quiet"])
    a = load_file(str(whole / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in rows(run)] == [r["step"] for r in rows(whole)]


def test_auto_strategy_follows_the_planner():
    from hivetune.workflows.workloads import qwen25_shape
    from hivetune.core.config import load_config
    from hivetune.parallel.distributed import choose_strategy

    cuda, gib = torch.device("cuda"), 2**30
    cfg = load_config(None, {"model": "x", "data": "y.jsonl", "precision": "bf16", "batch_size": 4, "max_length": 512})
    small = qwen25_shape(151936, 896, 4864, 24, 14, 2, True)  # 0.5B: fits one 24 GiB GPU
    big = qwen25_shape(152064, 5120, 13824, 48, 40, 8, False)  # 14B: 29.5 GB of bf16 weights
    assert choose_strategy("auto", 0, cuda, cfg, small, total_bytes=24 * gib) == "ddp"
    assert choose_strategy("auto", 0, cuda, cfg, big, total_bytes=24 * gib) == "fsdp"
    assert choose_strategy("auto", 0, cuda, cfg, big, total_bytes=141 * gib) == "ddp"
    assert choose_strategy("fsdp", 0, cuda, cfg, small, total_bytes=141 * gib) == "fsdp"
    assert choose_strategy("auto", 10**12, torch.device("cpu")) == "ddp"
    assert choose_strategy("auto", 20 * gib, cuda, total_bytes=24 * gib) == "fsdp"  # no plan: the base's size


def test_torchrun_worker_exit_keeps_output_and_exit_code(tmp_path):
    """Under torchrun (WORLD_SIZE > 1) `python -m hivetune` leaves with os._exit, skipping the
    interpreter's teardown (a joinable gloo thread aborted it): what was printed to a pipe still
    arrives, the file is whole, and the exit code is main's."""
    env = {**os.environ, "WORLD_SIZE": "2"}
    env.pop("PYTHONUNBUFFERED", None)  # a pipe is block-buffered: only a flush before os._exit keeps it
    out = tmp_path / "synth.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hivetune", "data", "synth", "--n", "5", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"wrote 5 examples to {out}\n") and "near-duplicate rate" in proc.stdout
    assert len(out.read_text().splitlines()) == 5
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hivetune", "data", "validate", str(missing)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr == f"hivetune: error: {missing}: data file not found\n"


def _allreduce_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from hivetune.parallel.distributed import Dist, allreduce_gradients
    from hivetune.ops.lora_grads import GradArena

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5)),
                  torch.nn.Parameter(torch.zeros(2, 2))]
        arena = GradArena(params, None)  # the CUDA graphs' gradients: views of one buffer
        for i, (p, g) in enumerate(zip(params, arena.grads)):
            g.copy_(torch.arange(g.numel(), dtype=torch.float32).view(g.shape) * (rank + 1) + i)
            p.grad = g
        from hivetune.ops.adamw import one_buffer

        assert one_buffer([p.grad for p in params]) is arena.flat  # so the in-place path is the one taken
        allreduce_gradients(params, Dist(rank=rank, world=2))
        assert all(p.grad is g for p, g in zip(params, arena.grads))  # reduced where they are
        torch.save([p.grad.clone() for p in params], f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_allreduce_sums_a_gradient_arena_in_place(tmp_path):
    """ddp's allreduce_gradients over gradients that are views of one GradArena buffer reduces
    the buffer itself (no flat copy): every rank ends with the sum over ranks, in its views."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_allreduce_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, shape in enumerate([(3, 4), (5,), (2, 2)]):
        n = 1
        for d in shape:
            n *= d
        want = torch.arange(n, dtype=torch.float32).view(shape) * 3 + 2 * i  # (rank 0 + 1) + (rank 1 + 1) = 3
        assert torch.equal(got[0][i], want) and torch.equal(got[1][i], want)
