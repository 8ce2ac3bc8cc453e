"""ops.offload (activation_offload) on CUDA: pinned host copies on a side stream. Loss and LoRA
gradients bit for bit those of no offload, the peak memory lower by what the planner predicts,
training through fit alike, and CUDA-graphed micro-batches left alone.

Bit for bit needs a step that is deterministic by itself, which the fast path is not: flash
attention's backward adds dq up with atomics (two runs of one step differ in the last bits now
and then, offload or not: measured on an H200), and so do the split dropout-matmul kernels. The
bitwise tests therefore run attention as plain fp32 matmuls per example (``math_attention``)
and dropout_seeded + cuBLAS in place of the dropout-matmul kernels; everything else is the
fast path (Triton RMSNorm / RoPE / SwiGLU with its in-place gradient, lora_group, the seeded
dropout, the fused loss)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hivetune.workflows.workloads import qwen25_shape, random_model, workload_examples
from hivetune.core.config import load_config
from hivetune.data.batch import collate_packed
from hivetune.data.dataset import TokenizedExamples
from hivetune.model.lora import LoRASpec, apply_lora, fuse_projections, lora_parameters
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.ops.offload import ActivationOffload
from hivetune.train.loop import fit
from hivetune.train.setup import assemble

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 4096


def math_attention(q, k, v, layout=None, cache=None, layer: int = 0):
    """Causal attention of each packed example as fp32 matmuls and a softmax: deterministic.
    q [1, T, H, D], k / v [1, T, KVH, D] -> [1, T, H, D]; the examples from layout.lengths."""
    heads, kv, d = q.shape[2], k.shape[2], q.shape[3]
    outs, start = [], 0
    for n in layout.lengths:
        qi, ki, vi = (t[0, start:start + n].transpose(0, 1).float() for t in (q, k, v))  # [heads, n, D]
        ki, vi = (t[:, None].expand(kv, heads // kv, n, d).reshape(heads, n, d) for t in (ki, vi))
        scores = (qi @ ki.transpose(1, 2)) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((scores.softmax(-1) @ vi).transpose(0, 1).to(q.dtype))
        start += n
    return torch.cat(outs)[None]


@pytest.fixture
def deterministic(monkeypatch):
    monkeypatch.setattr("hivetune.model.decoder.causal_attention", math_attention)
    monkeypatch.setattr("hivetune.ops.lora_dropout.DROP_MM_MIN_D", 1 << 30)  # dropout_seeded + cuBLAS


def lora_model(layers: int, hidden: int, intermediate: int, heads: int, kv: int, dropout: float):
    """The training path: bf16 base, fp32 LoRA (r 8, every projection, B nonzero), joined groups."""
    model = random_model(qwen25_shape(VOCAB, hidden, intermediate, layers, heads, kv, True), "cuda", torch.bfloat16)
    torch.manual_seed(0)
    apply_lora(model, LoRASpec(r=8, alpha=16, dropout=dropout))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.02)
    fuse_projections(model)
    return model.train()


def packed(n: int = 16):
    return collate_packed(workload_examples(n, VOCAB, cap=0, seed=1), pad_id=0).to("cuda")


def loss_and_grads(model, batch):
    torch.manual_seed(3)  # the same dropout seeds in every run
    for p in lora_parameters(model):
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = model(batch.input_ids, batch.position_ids, batch.layout)
        loss = fused_target_loss_sum(hidden, model.lm_head.weight, batch.target_index, batch.target_ids)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in lora_parameters(model)]


def assert_bitwise(a, b):
    assert torch.equal(a[0], b[0]), (a[0].item(), b[0].item())
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert torch.equal(x, y), (i, (x - y).abs().max().item())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_offload_is_bitwise_on_cuda(dropout, deterministic):
    """Half the layers offloaded: ~3,200 tokens of hidden 512, so the default 1 MiB threshold
    moves the [T, hidden] tensors and the [T, 2 I] gate|up output (saved by SwiGLU and by
    down_proj, copied once; SwiGLU's backward writes its gradient over it in place)."""
    model = lora_model(4, 512, 1408, 8, 2, dropout)
    batch = packed()
    loss_and_grads(model, batch)  # first call: lazy inits
    plain = loss_and_grads(model, batch)
    assert_bitwise(plain, loss_and_grads(model, batch))  # the step itself is deterministic
    model.activation_offload = offload = ActivationOffload(model, 2)
    for _ in range(3):  # later passes reuse the first one's pinned chunks
        assert_bitwise(plain, loss_and_grads(model, batch))
    stats = offload.stats
    assert stats["passes"] == 3 and stats["copies"] > 0 and stats["late"] == 0
    # with the seeded dropout, q/k/v keep the norm's input and down_proj the gate|up output
    # (their `source`), storages RMSNorm and SwiGLU save too: each copied once
    assert stats["saved"] > stats["copies"] if dropout else stats["saved"] == stats["copies"]
    assert offload.arena.free and all(c.is_pinned() for c in offload.arena.free)


def test_offload_lowers_peak_memory():
    """Half the layers offloaded (real flash attention): max_memory_allocated falls by at least
    80% of what the planner predicts (the offloaded storages, less the one layer the prefetch
    window holds beyond the kept ones when N = L / 2), and the pack hook moves what the planner
    says it moves."""
    from hivetune.ops import triton_util
    from hivetune.ops.attention import _varlen_fn, varlen_supported
    from hivetune.plan.memory import MemoryConfig, breakdown, offloaded_bytes

    layers, n = 8, 4
    model = lora_model(layers, 1024, 2816, 16, 4, 0.0)
    batch = packed()
    tokens = batch.input_ids.shape[1]

    def peak_delta():
        loss_and_grads(model, batch)  # warm: Triton, cuBLAS workspaces, the pinned chunks
        for p in lora_parameters(model):
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss_and_grads(model, batch)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    plain = peak_delta()
    model.activation_offload = offload = ActivationOffload(model, n)
    moved = peak_delta()
    per_pass = offload.stats["bytes"] // offload.stats["passes"]

    varlen = varlen_supported(batch.input_ids.new_empty((1, 1, 1, 1), dtype=torch.bfloat16))
    mc = MemoryConfig(precision="bf16", r=8, fused_layers=triton_util.triton is not None,
                      attention="varlen" if varlen else "sdpa", gqa_native=_varlen_fn()[2])
    args = model.args

    def torch_bytes(b):
        return sum(v for k, v in b.parts.items() if k not in ("allocator slack", "CUDA context"))

    with_offload = MemoryConfig(**{**mc.__dict__, "offload_layers": n})
    predicted = torch_bytes(breakdown(args, mc, tokens)) - torch_bytes(breakdown(args, with_offload, tokens))
    planned = offloaded_bytes(args, with_offload, tokens)
    assert abs(per_pass / planned - 1) < 0.03, (per_pass, planned)
    assert plain - moved >= 0.8 * predicted, (plain, moved, predicted, planned)


def small_run(tmp_path: Path, **cfg):
    """A run through train.assemble: 4 layers, 16 examples (~3,200 tokens) a micro-batch, so the
    default 1 MiB threshold moves the [T, hidden] and larger tensors."""
    model = random_model(qwen25_shape(VOCAB, 512, 1408, 4, 8, 2, True), "cuda", torch.bfloat16)
    examples = TokenizedExamples(workload_examples(64, VOCAB, cap=0, seed=5))
    values = {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda", "batch_size": 16,
              "max_steps": 2, "lr": 1e-3, "warmup_steps": 0, "eval_prompts": 0, "max_length": 4096,
              "lora": {"r": 8, "alpha": 16, "dropout": 0.1}, **cfg}
    run = assemble(load_config(None, values), model, examples, None, torch.device("cuda"), "bf16",
                   tmp_path / "run", Path("random"))
    with torch.no_grad():  # B = 0 at init: give the update values so every gradient is non-trivial
        for p in lora_parameters(model):
            p.normal_(0, 0.02)
    return run


def fit_losses(run):
    fit(run, progress=False)
    losses = [json.loads(line)["loss"] for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
    return losses, [p.detach().clone() for p in lora_parameters(run.model)]


def test_fit_with_activation_offload_matches(tmp_path, deterministic):
    """Two optimizer steps through fit (eager) with activation_offload = half the layers: the
    losses and the trained LoRA weights of the run without it, bit for bit."""
    plain = fit_losses(small_run(tmp_path / "plain", cuda_graphs=False))
    run = small_run(tmp_path / "offload", cuda_graphs=False, activation_offload=2)
    offload = run.model.activation_offload
    assert isinstance(offload, ActivationOffload)
    moved = fit_losses(run)
    assert len(moved[0]) == 2 and moved[0] == plain[0]
    for a, b in zip(plain[1], moved[1]):
        assert torch.equal(a, b)
    assert offload.stats["passes"] == 2 and offload.stats["copies"] > 0 and offload.stats["late"] == 0


def test_graphed_micro_batches_skip_the_offload(tmp_path, capsys):
    """With cuda_graphs the first micro-batch runs eagerly (offloaded) before the captures; the
    captured graphs hold no offload (one stderr line says so) and replay as without it."""
    from hivetune.train import replay as graphs
    plain = fit_losses(small_run(tmp_path / "plain"))
    run = small_run(tmp_path / "offload", activation_offload=2)
    moved = fit_losses(run)
    assert graphs.last_stats["graphs"] > 0 and graphs.last_stats["replays"] > 0
    assert run.model.activation_offload.stats["passes"] == 1  # the eager warm-up alone
    assert "activation_offload skips CUDA-graphed micro-batches" in capsys.readouterr().err
    assert moved[0] == pytest.approx(plain[0], rel=1e-4)  # flash attention's atomics: not bitwise
