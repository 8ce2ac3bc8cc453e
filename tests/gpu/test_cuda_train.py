"""The same code on a CUDA GPU: parity with the CPU, training in bf16 / fp16, generation."""

from __future__ import annotations

import json

import pytest
import torch

from hivetune.core.config import load_config
from hivetune.workflows.generate import greedy_ids
from hivetune.model.load import load_model
from hivetune.train.loop import fit
from hivetune.train.setup import setup

from conftest import bf16_loss_and_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_losses(model_dir, data, out, **kw):
    values = {"model": str(model_dir), "data": str(data), "output_dir": str(out), "eval_prompts": 0,
              "batch_size": 4, "max_steps": 6, "lr": 5e-3, "warmup_steps": 0, "lora": {"r": 4, "alpha": 8}}
    values.update(kw)
    run = setup(load_config(None, values))
    fit(run, progress=False)
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()], run


def test_cuda_fp32_matches_cpu_fp32(tiny_model_dir, alpaca_file, tmp_path):
    cpu, _ = run_losses(tiny_model_dir, alpaca_file, tmp_path / "cpu", device="cpu", precision="fp32")
    gpu, run = run_losses(tiny_model_dir, alpaca_file, tmp_path / "gpu", device="cuda", precision="fp32")
    assert run.device.type == "cuda"
    # The first loss is one forward pass: only reduction order differs. Later steps compound
    # those differences through AdamW at lr 5e-3 (measured on an H200: 1.7e-3 relative by step 3).
    assert gpu[0] == pytest.approx(cpu[0], rel=1e-5)
    assert gpu == pytest.approx(cpu, rel=5e-3)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_half_precision_tracks_fp32(precision, tiny_model_dir, alpaca_file, tmp_path):
    ref, _ = run_losses(tiny_model_dir, alpaca_file, tmp_path / "ref", device="cuda", precision="fp32")
    half, run = run_losses(tiny_model_dir, alpaca_file, tmp_path / precision, device="cuda", precision=precision)
    assert run.model.model.layers[0].mlp.up_proj.base_layer.weight.dtype == {"bf16": torch.bfloat16,
                                                                             "fp16": torch.float16}[precision]
    assert run.model.model.layers[0].mlp.up_proj.lora_A.weight.dtype == torch.float32
    assert half == pytest.approx(ref, rel=2e-2)
    assert half[-1] < half[0]


def test_cuda_packed_equals_padded_losses_bf16(tiny_model_dir, alpaca_file, tmp_path):
    packed, _ = run_losses(tiny_model_dir, alpaca_file, tmp_path / "packed", device="cuda", precision="bf16")
    padded, _ = run_losses(tiny_model_dir, alpaca_file, tmp_path / "padded", device="cuda", precision="bf16",
                           packing=False)
    assert packed == pytest.approx(padded, rel=1e-2)


def test_cuda_generation_equals_cpu(tiny_model_dir):
    cpu = load_model(tiny_model_dir)
    gpu = load_model(tiny_model_dir, device="cuda")
    prompts = [[1, 5, 9, 33, 70], [1, 2, 3]]
    assert greedy_ids(gpu, prompts, 8, set()) == greedy_ids(cpu, prompts, 8, set())


def test_varlen_attention_matches_sdpa_reference(tiny_model_dir, monkeypatch):
    """The flash varlen path and the SDPA reference give the same packed forward and grads."""
    from hivetune.data.batch import collate_packed
    from hivetune.data.formats import Encoded
    from hivetune.model.lora import LoRASpec, apply_lora, lora_parameters
    from hivetune.ops import attention
    model = load_model(tiny_model_dir, dtype=torch.bfloat16, device="cuda")
    torch.manual_seed(0)
    apply_lora(model, LoRASpec(r=4, alpha=8, dropout=0.0))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.05)
    examples = [Encoded(list(range(3 + i, 40 + 7 * i)), [False] * 5 + [True] * (32 + 6 * i)) for i in range(5)]
    batch = collate_packed(examples, pad_to_multiple=64, pad_id=0).to("cuda")
    assert batch.layout.lengths[-1] > 0 and sum(batch.layout.lengths) == batch.input_ids.shape[1]

    assert attention.varlen_supported(torch.zeros(1, 1, 1, 1, device="cuda", dtype=torch.bfloat16))
    fast_loss, fast_grads = bf16_loss_and_grads(model, batch)
    monkeypatch.setattr(attention, "_BACKEND", "sdpa")  # the config key attention: sdpa
    ref_loss, ref_grads = bf16_loss_and_grads(model, batch)
    assert torch.isfinite(fast_grads).all()
    assert fast_loss == pytest.approx(ref_loss, rel=1e-2)
    assert torch.nn.functional.cosine_similarity(fast_grads, ref_grads, dim=0).item() > 0.999


@pytest.mark.parametrize("layers", [0, 1], ids=["all-layers", "first-layer"])
def test_cuda_bf16_gradient_checkpointing_tracks_plain(layers, tiny_model_dir, alpaca_file, tmp_path):
    """bf16 + checkpointing on CUDA trains (the varlen probe must not run inside a checkpointed
    forward's saved-tensor hooks) and gives the plain run's losses; so does checkpointing the
    first layer only (checkpoint_layers)."""
    import subprocess
    import sys

    # A fresh process: the probe of flash varlen attention has not run yet there.
    code = ("import json, sys; from hivetune.core.config import load_config; from hivetune.train.loop import fit; from hivetune.train.setup import setup; "
            "run = setup(load_config(None, json.loads(sys.argv[1]))); fit(run, progress=False)")
    values = {"model": str(tiny_model_dir), "data": str(alpaca_file), "output_dir": str(tmp_path / "ckpt"),
              "eval_prompts": 0, "batch_size": 4, "max_steps": 6, "lr": 5e-3, "warmup_steps": 0,
              "lora": {"r": 4, "alpha": 8}, "device": "cuda", "precision": "bf16", "gradient_checkpointing": True,
              "checkpoint_layers": layers}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(values)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = [json.loads(line)["loss"] for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    plain, _ = run_losses(tiny_model_dir, alpaca_file, tmp_path / "plain", device="cuda", precision="bf16")
    assert ckpt == pytest.approx(plain, rel=1e-2)


def test_ddp_step_reduction_does_not_wait_for_the_gpu(monkeypatch):
    """reduce_step under torchrun queues its work: no host sync (a host scalar copied to the GPU
    synced every DDP step, leaving the GPU idle while the host queued the rest of the step)."""
    from hivetune.parallel import distributed
    from hivetune.train.loop import reduce_step

    monkeypatch.setattr(distributed, "sum_across", lambda d, t: t.mul_(2))  # two alike ranks, no group
    loss = torch.full((), 1.5, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        total, tokens, signal = reduce_step(distributed.Dist(0, 2, 0), loss, 10, 2, 40)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (total.item(), tokens, bool(signal)) == (3.0, 40, True)


def test_adapter_tensors_come_to_the_host_in_one_copy_alike():
    """lora.to_host: the GPU tensors batched into one copy give each tensor's values, shape and
    dtype, each in its own storage (safetensors refuses shared ones); CPU tensors pass through."""
    from safetensors.torch import load, save

    from hivetune.model.lora import to_host

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {f"w{i}": torch.randn(shape, device="cuda", generator=g) for i, shape in
               enumerate([(16, 64), (64, 16), (3,), (8, 8)])}
    tensors["w1"] = tensors["w1"].t()  # a non-contiguous view
    tensors["cpu"] = torch.arange(5.0)
    host = to_host(tensors)
    assert list(host) == list(tensors)
    for key, t in tensors.items():
        assert host[key].device.type == "cpu" and host[key].shape == t.shape
        assert torch.equal(host[key], t.cpu())
    assert len({h.untyped_storage().data_ptr() for h in host.values()}) == len(host)
    back = load(save(host))
    assert all(torch.equal(back[k], host[k]) for k in host)
