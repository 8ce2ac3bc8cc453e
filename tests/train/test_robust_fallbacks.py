"""Fast paths chosen by capability with a logged fallback (hivetune.core.fallbacks), forced and compared on
the CPU: the varlen-attention probe (working, raising, wrong), fused vs foreach AdamW, and fp32 in
place of CPU bf16 autocast. The CUDA side is tests/gpu/test_fallbacks.py. About 5 s."""

from __future__ import annotations

import json

import pytest
import torch

import hivetune.ops.attention as attention
from hivetune.core import device as device_module
from hivetune.core import fallbacks
from hivetune.core.device import resolve_precision
from hivetune.core.fallbacks import FORCE_ENV
from hivetune.ops import adamw as adamw_module
from hivetune.ops import prewarm as prewarm_module
from hivetune.ops.adamw import adamw
from hivetune.ops.attention import probe_varlen, varlen_usable
from hivetune.train.loop import fit
from hivetune.train.setup import setup
from conftest import tiny_config

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Each test starts with no fallback noted and no probe cached."""
    monkeypatch.setattr(fallbacks, "NOTED", {})
    monkeypatch.setattr(attention, "_VARLEN_OK", {})
    monkeypatch.setattr(attention, "_BACKEND", "auto")
    monkeypatch.delenv(FORCE_ENV, raising=False)


def fake_varlen(wrong: bool = False):
    """A CPU stand-in for torch's varlen_attn: causal attention per cu_seqlens segment."""
    def run(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        groups = q.shape[1] // k.shape[1]
        bounds = cu_q.tolist()
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
            ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
            outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        out = torch.cat(outs).to(q.dtype)
        return out * 1.5 if wrong else out
    return run


def test_varlen_probe_on_this_cpu_names_why_it_is_off(capsys):
    reason = probe_varlen(CPU, torch.bfloat16)
    assert reason.startswith("NotImplementedError: Could not run 'aten::_flash_attention_forward'")
    assert varlen_usable(CPU, torch.bfloat16) is False
    assert capsys.readouterr().err == ""  # the CPU's designed path is the reference: nothing to note
    q = torch.zeros(1, 4, 2, 8)
    assert attention.varlen_supported(q) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_probe_accepts_a_working_kernel_and_refuses_a_wrong_one(dtype, monkeypatch):
    monkeypatch.setattr(attention, "_varlen_fn", lambda: (fake_varlen(), False, True))
    assert probe_varlen(CPU, dtype) == ""
    monkeypatch.setattr(attention, "_varlen_fn", lambda: (fake_varlen(wrong=True), False, True))
    assert probe_varlen(CPU, dtype) in ("wrong result on a tiny input (relative error 0.5)",
                                        "wrong result on a tiny input (relative error 0.504)")  # bf16 rounding

    def broken(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore text")

    monkeypatch.setattr(attention, "_varlen_fn", lambda: (broken, False, True))
    assert probe_varlen(CPU, dtype) == "RuntimeError: FlashAttention only supports Ampere GPUs or newer."
    monkeypatch.setattr(attention, "_varlen_fn", lambda: (None, False, False))
    assert probe_varlen(CPU, dtype) == "torch.nn.attention.varlen.varlen_attn is not in this torch"


def test_varlen_fallback_on_a_gpu_is_one_line_once(monkeypatch, capsys):
    """Faked: the probe fails on 'cuda' -> one note line, cached, however often attention asks."""
    monkeypatch.setattr(attention, "probe_varlen", lambda device, dtype: "RuntimeError: no kernel image")
    gpu = torch.device("cuda", 0)
    assert [varlen_usable(gpu, torch.bfloat16) for _ in range(3)] == [False] * 3
    assert capsys.readouterr().err.splitlines() == [
        "hivetune: note: flash varlen attention unavailable (RuntimeError: no kernel image); using SDPA over a "
        "padded view"]
    monkeypatch.setattr(fallbacks, "NOTED", {})
    monkeypatch.setenv(FORCE_ENV, "varlen")
    assert varlen_usable(gpu, torch.float16) is False
    assert capsys.readouterr().err.splitlines() == [
        "hivetune: note: flash varlen attention unavailable (HIVETUNE_REFERENCE asks for the reference); using SDPA"]


def adam_steps(optimizer, params, steps=4):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return [p.detach().clone() for p in params]


def make_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(16, 8, generator=gen)), torch.nn.Parameter(torch.randn(8, generator=gen))]


def test_fused_adamw_matches_foreach_and_falls_back_with_one_line(monkeypatch, capsys):
    fast_params, ref_params = make_params(), make_params()
    fast = adamw(fast_params, 1e-2, 0.01, fused=True)  # torch fuses AdamW on the CPU too
    ref = adamw(ref_params, 1e-2, 0.01, fused=False)
    assert fast.defaults["fused"] is True and not ref.defaults["fused"]
    for a, b in zip(adam_steps(fast, fast_params), adam_steps(ref, ref_params)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert capsys.readouterr().err == ""

    real = torch.optim.AdamW

    def no_fused(params, **kw):
        if kw.get("fused"):
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported "
                               "devices: ['cuda', 'xpu']")
        return real(params, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    monkeypatch.setattr(adamw_module, "FusedAdamW", no_fused)  # what adamw() builds when torch can fuse
    params = make_params()
    fallback = adamw(params, 1e-2, 0.01, fused=True)
    assert not fallback.defaults["fused"]
    plain_params = make_params()
    plain = real(plain_params, lr=1e-2, weight_decay=0.01)
    for a, b in zip(adam_steps(fallback, params), adam_steps(plain, plain_params)):
        assert torch.equal(a, b)
    assert capsys.readouterr().err.splitlines() == [
        "hivetune: note: fused AdamW unavailable (`fused=True` requires all the params to be floating point Tensors "
        "of supported devices: ['cuda', 'xpu']); using foreach AdamW"]
    monkeypatch.setattr(torch.optim, "AdamW", real)
    monkeypatch.setattr(fallbacks, "NOTED", {})
    monkeypatch.setenv(FORCE_ENV, "fused_adamw")
    assert not adamw(make_params(), 1e-2, 0.0, fused=True).defaults["fused"]
    assert "HIVETUNE_REFERENCE asks for the reference" in capsys.readouterr().err


def test_cpu_without_fast_bf16_trains_in_fp32_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(device_module, "cpu_has_fast_bf16", lambda: False)
    assert [resolve_precision("auto", CPU) for _ in range(2)] == ["fp32", "fp32"]
    assert capsys.readouterr().err.splitlines() == [
        "hivetune: note: fast bf16 autocast unavailable (this CPU has no AMX or AVX512-BF16); using fp32"]
    assert resolve_precision("bf16", CPU) == "bf16"  # asked for explicitly: no fallback
    monkeypatch.setattr(device_module, "cpu_has_fast_bf16", lambda: True)
    assert resolve_precision("auto", CPU) == "bf16"
    monkeypatch.setenv(FORCE_ENV, "all")
    assert resolve_precision("auto", CPU) == "fp32"


def test_cpu_bf16_autocast_tracks_its_fp32_fallback(tiny_model_dir, alpaca_file, tmp_path, monkeypatch):
    """The same 4 steps with bf16 autocast (the fast path, forced on) and with the fp32 fallback."""
    losses = {}
    for name, force in (("bf16", False), ("fp32", True)):
        monkeypatch.setattr(device_module, "cpu_has_fast_bf16", lambda: True)
        if force:
            monkeypatch.setenv(FORCE_ENV, "cpu_bf16")
        run = setup(tiny_config(tiny_model_dir, alpaca_file, tmp_path / name, precision="auto", max_steps=4))
        assert run.precision == name
        fit(run, progress=False)
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert losses["bf16"] != losses["fp32"]  # really two paths


def test_the_varlen_probe_runs_clean_inside_a_checkpointed_forward(monkeypatch):
    """attention asks first from inside a forward: under autocast, no_grad or a checkpointed
    layer's saved-tensor hooks, where a backward fails; the probe runs in its own thread."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(attention, "_varlen_fn", lambda: (fake_varlen(), False, True))
    seen = []

    def layer(x):
        seen.append(varlen_usable(torch.device("cuda", 0), torch.bfloat16))  # faked GPU: the probe runs on the CPU
        return x * 2

    monkeypatch.setattr(attention, "probe_varlen", lambda device, dtype: probe_varlen(CPU, dtype))
    x = torch.ones(3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert seen[0] is True and fallbacks.NOTED == {}
    with torch.no_grad():
        assert fallbacks.isolated(probe_varlen, CPU, torch.float32) == ""


def test_join_prewarm_waits_for_the_thread_still_running(monkeypatch):
    """prewarm.join_prewarm (train.fit, before the first step) returns once prewarm's
    thread has finished, and at once where none runs."""
    import threading
    import time

    release = threading.Event()
    done = []

    def warm():
        release.wait(5)
        time.sleep(0.05)
        done.append(True)

    thread = threading.Thread(target=warm, daemon=True)
    monkeypatch.setattr(prewarm_module, "_PREWARM", thread)
    thread.start()
    release.set()
    prewarm_module.join_prewarm()
    assert done == [True] and not thread.is_alive()
    monkeypatch.setattr(prewarm_module, "_PREWARM", None)
    prewarm_module.join_prewarm()  # nothing to wait for


def test_prewarm_computes_the_cache_key_in_the_background(monkeypatch):
    """The first Triton launch hashes Triton's own files; prewarm does it before the model
    loads. Nothing on the CPU; on CUDA a thread fills triton_key's cache, once per process."""
    monkeypatch.setattr(prewarm_module, "_PREWARM", None)
    prewarm_module.prewarm(torch.device("cpu"))
    assert prewarm_module._PREWARM is None
    cache = pytest.importorskip("triton.runtime.cache")
    cache.triton_key.cache_clear()
    prewarm_module.prewarm(torch.device("cuda"))
    thread = prewarm_module._PREWARM
    thread.join(60)
    assert cache.triton_key.cache_info().currsize == 1 and prewarm_module.PREWARM_DONE_AT is not None
    prewarm_module.prewarm(torch.device("cuda"))
    assert prewarm_module._PREWARM is thread


def test_prewarm_thread_runs_the_tail_kernels_and_reports_how_they_went(monkeypatch):
    """The prewarm thread runs prewarm.tail_kernels on the device it was given and records how it
    went (PREWARM_TAIL) before it marks itself done.
    (Here the kernels' run is a stand-in: this machine has no CUDA.)"""
    seen = []
    monkeypatch.setattr(prewarm_module, "tail_kernels", lambda device: seen.append(device))
    monkeypatch.setenv("HIVETUNE_REFERENCE", "fused_layers")
    for name, value in (("_PREWARM", None), ("PREWARM_TAIL", None), ("PREWARM_DONE_AT", None)):
        monkeypatch.setattr(prewarm_module, name, value)
    prewarm_module.prewarm(torch.device("cuda", 1))
    prewarm_module.join_prewarm()
    assert seen == [torch.device("cuda", 1)]
    assert prewarm_module.PREWARM_TAIL.endswith(" ms") and prewarm_module.PREWARM_DONE_AT is not None
    monkeypatch.setattr(prewarm_module, "tail_kernels", lambda device: 1 / 0)  # a failure: its line, no raise
    monkeypatch.setenv("HIVETUNE_REFERENCE", "fused_layers")
    monkeypatch.setattr(prewarm_module, "_PREWARM", None)
    prewarm_module.prewarm(torch.device("cuda", 0))
    prewarm_module.join_prewarm()
    assert prewarm_module.PREWARM_TAIL == "ZeroDivisionError: division by zero"


def test_quiet_gc_freezes_the_loops_start_and_restores_the_collector():
    import gc

    from hivetune.core.collector import quiet_gc

    before = gc.get_threshold()
    with quiet_gc():
        assert gc.get_threshold()[0] == 50_000
        assert gc.get_freeze_count() > 1000  # the test process's objects, frozen
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_bf16_weights_train_without_autocast_to_the_same_bits(tmp_path, dropout):
    """A model whose frozen weights are bf16 and whose LoRA layers all run through lora_group
    trains without autocast (train.autocast): the same loss and LoRA gradients, bit for bit, as
    with it (runs_in_dtype off); an fp32 model keeps autocast."""
    from hivetune.workflows.workloads import qwen25_shape, random_model, workload_examples
    from hivetune.core.config import load_config
    from hivetune.data.batch import collate_packed
    from hivetune.data.dataset import TokenizedExamples
    from hivetune.model.lora import lora_parameters
    from hivetune.ops.loss import target_loss_sum
    from hivetune.train.setup import assemble
    from hivetune.train.step import autocast, forward_backward
    from pathlib import Path

    args = qwen25_shape(vocab=2100, hidden=64, intermediate=128, layers=2, heads=4, kv=2, tied=True)
    values = {"model": "random", "data": "generator", "device": "cpu", "precision": "bf16", "eval_prompts": 0,
              "lora": {"r": 4, "alpha": 8, "dropout": dropout}}
    examples = TokenizedExamples(workload_examples(8, 2100, cap=160, seed=3))
    run = assemble(load_config(None, values), random_model(args, "cpu", torch.bfloat16), examples, None,
                   torch.device("cpu"), "bf16", tmp_path / "run", Path("random"))
    with torch.no_grad():
        for p in lora_parameters(run.model):
            p.normal_(0, 0.05)
    run.model.train()
    assert run.model.runs_in_dtype and not torch.is_autocast_enabled("cpu")
    batch = collate_packed([examples.example(i) for i in range(4)], pad_id=0)
    assert batch.target_ids.numel() > 100

    def loss_and_grads():
        for p in lora_parameters(run.model):
            p.grad = None
        torch.manual_seed(5)
        loss = forward_backward(run, batch, 100, target_loss_sum)
        return loss, [p.grad.clone() for p in lora_parameters(run.model)]

    with autocast(run):
        assert not torch.is_autocast_enabled("cpu")
    loss, grads = loss_and_grads()
    run.model.runs_in_dtype = False  # what autocast does to the same model
    with autocast(run):
        assert torch.is_autocast_enabled("cpu")
    loss_ref, grads_ref = loss_and_grads()
    assert torch.equal(loss, loss_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    fp32 = assemble(load_config(None, {**values, "precision": "fp32"}), random_model(args, "cpu", torch.float32),
                    examples, None, torch.device("cpu"), "bf16", tmp_path / "run32", Path("random"))
    assert not fp32.model.runs_in_dtype


def test_forced_follows_every_change_of_the_environment(monkeypatch):
    """forced() parses HIVETUNE_REFERENCE again after each set and delete."""
    monkeypatch.setenv(FORCE_ENV, "cublaslt, fused_layers")
    assert fallbacks.forced("fused_layers") and fallbacks.forced("cublaslt") and not fallbacks.forced("varlen")
    monkeypatch.setenv(FORCE_ENV, "all")
    assert fallbacks.forced("varlen")
    monkeypatch.delenv(FORCE_ENV)
    assert not fallbacks.forced("varlen")


def test_attention_key_picks_the_path_and_flash_refuses_a_failing_probe(monkeypatch, capsys):
    """attention (train setup: ops.switches.configure_ops): sdpa never asks for varlen; flash
    raises the probe's reason where auto falls back with its line; a bad value is one error line."""
    from hivetune.core.config import load_config
    from hivetune.core.errors import UserError
    from hivetune.ops import triton_util
    from hivetune.ops.switches import configure_ops

    monkeypatch.setattr(attention, "probe_varlen", lambda device, dtype: "RuntimeError: no kernel image")
    monkeypatch.setattr(triton_util, "_FUSED_OPS", True)
    gpu = torch.device("cuda", 0)
    configure_ops("flash", False)
    assert triton_util._FUSED_OPS is False
    with pytest.raises(UserError, match=r"attention: flash varlen attention does not run here \(RuntimeError"):
        varlen_usable(gpu, torch.bfloat16)
    assert capsys.readouterr().err == ""
    configure_ops("auto", True)
    assert varlen_usable(gpu, torch.bfloat16) is False
    assert "using SDPA over a padded view" in capsys.readouterr().err
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    configure_ops("sdpa", True)
    monkeypatch.setattr(attention, "varlen_usable", lambda device, dtype: 1 / 0)  # never asked
    assert attention.varlen_supported(torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)) is False
    with pytest.raises(UserError, match="attention: 'fast' is not one of auto, flash, sdpa"):
        load_config(None, {"model": "random", "data": "generator", "attention": "fast"})
    assert load_config(None, {"model": "random", "data": "generator"}).fused_ops is True
