"""Preference rows on a CUDA GPU: the flash pair path (ops.shared_prompt) against the dense-mask
reference, alone and through a DPO micro-batch's losses and LoRA gradients."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config, write_jsonl
from hivetune.data.pairs import collate_pairs
from hivetune.model.lora import lora_parameters
from hivetune.ops import shared_prompt
from hivetune.ops.shared_prompt import flash_pair_attention, pair_segments, pairs_usable, reference_pair_attention
from hivetune.train.preference import pair_losses
from hivetune.train.setup import setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pair_records(n: int) -> list[dict]:
    return [{"prompt": f"How do I restart service number {i}?", "chosen": f"Run `systemctl restart svc{i}` as root.",
             "rejected": f"Use rpm-ostree status on host {i + 1}, then reboot twice."} for i in range(n)]


def pref_run(model_dir, data, out, **kw):
    run = setup(tiny_config(model_dir, data, out, method="dpo", batch_size=4, max_steps=3, **kw))
    with torch.no_grad():  # B non-zero: the policy differs from the reference
        generator = torch.Generator().manual_seed(3)
        for p in lora_parameters(run.model):
            p.copy_((torch.randn(p.shape, generator=generator) * 0.05).to(p.device))
    return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_pair_attention_matches_the_dense_mask(dtype):
    assert pairs_usable(torch.device("cuda"), dtype)  # the probe passes: no silent fallback
    lengths = [(37, 80, 12), (5, 1, 140), (200, 64, 64), (1, 9, 3)]
    gen = torch.Generator().manual_seed(0)
    t = sum(map(sum, lengths))
    q, k, v = (torch.randn(1, t, h, 64, generator=gen) for h in (14, 2, 2))
    qd, kd, vd = (x.to("cuda", dtype).requires_grad_() for x in (q, k, v))
    out = flash_pair_attention(qd, kd, vd, pair_segments(lengths).to("cuda"))
    w = torch.randn(out.shape, generator=gen)
    (out.float() * w.cuda()).sum().backward()
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    ref = reference_pair_attention(q, k, v, lengths)
    (ref * w.double()).sum().backward()
    scale = ref.abs().max().item()
    assert (out.double().cpu() - ref.detach()).abs().max().item() < 2e-2 * scale
    for got, want in ((qd.grad, q.grad), (kd.grad, k.grad), (vd.grad, v.grad)):
        err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
        assert err < 3e-2, err


def test_dpo_micro_batch_flash_equals_reference(tiny_model_dir, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_records(12))
    run = pref_run(tiny_model_dir, data, tmp_path / "run", device="cuda", precision="bf16")
    batch = collate_pairs([run.data.example(i) for i in range(8)], run.pad_id, True).to(run.device)
    calls = []

    def counted(*args):
        calls.append(1)
        return flash_pair_attention(*args)

    monkeypatch.setattr(shared_prompt, "flash_pair_attention", counted)
    results = []
    for reference in (False, True):
        if reference:
            monkeypatch.setenv("HIVETUNE_REFERENCE", "pairs")
        params = lora_parameters(run.model)
        losses, chosen, rejected = pair_losses(run, batch)
        grads = torch.autograd.grad(losses.sum(), params)
        results.append((losses.detach().float(), chosen.float(), rejected.float(), grads))
        if not reference:
            assert calls, "the flash pair path did not run"
            n_flash = len(calls)
    assert len(calls) == n_flash  # the reference run took the mask path
    (lf, cf, rf, gf), (lr, cr, rr, gr) = results
    torch.testing.assert_close(lf, lr, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(cf, cr, rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(rf, rr, rtol=5e-2, atol=5e-3)
    for a, b in zip(gf, gr):
        err = (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-6)
        assert err < 5e-2, err
