"""Training on a quantized base (base_quant nf4 / int8) on the tiny model, CPU fp32: the run
trains, checkpoints and resumes bit for bit; the adapter is PEFT's as on a dense base; a merged
export takes the dequantized base, with one line saying so."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import ops_records, write_jsonl
from hivetune.model.load import load_model
from hivetune.model.lora import load_adapter
from hivetune.model.quant import QuantLinear, dequantize_model, is_quantized
from hivetune.train.loop import TrainingStopped, fit
from hivetune.train.setup import setup
from hivetune.workflows.export import export
from test_resume import assert_bitwise_equal, metric_rows, run_cfg, same_numbers

QUANTS = ["nf4", "int8"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", ops_records(24))


@pytest.fixture(scope="module", params=QUANTS)
def reference(request, tiny_model_dir, data, tmp_path_factory):
    """6 steps on a quantized base, never interrupted: (quant, adapter tensors, metrics, folder)."""
    from hivetune.model.lora import lora_state_dict

    out = tmp_path_factory.mktemp(f"ref-{request.param}") / "run"
    run = setup(run_cfg(tiny_model_dir, data, out, base_quant=request.param))
    assert is_quantized(run.model) and getattr(run.model, "lora_casts", None) is not None  # joined groups
    fit(run, progress=False)
    return request.param, lora_state_dict(run.model), metric_rows(out), out


def test_quantized_run_trains_and_differs_from_dense(reference, tiny_model_dir, data, tmp_path):
    quant, tensors, rows, _ = reference
    losses = [r["loss"] for r in rows]
    assert len(losses) == 6 and all(l == l for l in losses) and losses[-1] < losses[0]
    assert any(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)
    dense = setup(run_cfg(tiny_model_dir, data, tmp_path / "dense"))
    fit(dense, progress=False)
    dense_losses = [r["loss"] for r in metric_rows(tmp_path / "dense")]
    assert dense_losses != losses  # the base differs by its quantization error
    assert abs(dense_losses[0] - losses[0]) < 0.05 * dense_losses[0]


def test_quantized_run_resumes_bit_for_bit(reference, tiny_model_dir, data, tmp_path):
    from hivetune.model.lora import lora_state_dict

    quant, tensors, rows, _ = reference
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out, base_quant=quant))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=3)
    resumed = setup(run_cfg(tiny_model_dir, data, out, base_quant=quant))
    assert resumed.start_step == 2
    fit(resumed, progress=False)
    assert_bitwise_equal(lora_state_dict(resumed.model), tensors)
    assert same_numbers(metric_rows(out)) == same_numbers(rows)


def test_adapter_is_peft_format_and_loads_on_the_quantized_base(reference, tiny_model_dir, tmp_path):
    quant, tensors, _, out = reference
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["base_model_name_or_path"] == str(tiny_model_dir)
    on_disk = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert_bitwise_equal(on_disk, tensors)
    assert export(out, "adapter", tmp_path / "peft").files == ["README.md", "adapter_config.json",
                                                              "adapter_model.safetensors"]
    assert (tmp_path / "peft" / "adapter_model.safetensors").read_bytes() == \
        (out / "adapter" / "adapter_model.safetensors").read_bytes()


def test_merged_export_uses_the_dequantized_base(reference, tiny_model_dir, tmp_path, capsys):
    quant, _, _, out = reference
    export(out, "merged", tmp_path / "merged")
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"hivetune: export: the run trained on a {quant} base: the update is merged into its dequantized "
        f"weights; merging into a quantized base changes the weights (the adapter on the {quant} base keeps them)")
    merged = load_model(tmp_path / "merged")
    trained = load_model(tiny_model_dir, base_quant=quant)
    load_adapter(trained, out / "adapter")
    assert isinstance(trained.model.layers[0].self_attn.q_proj.base_layer, QuantLinear)
    ids = torch.randint(3, 384, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = trained.logits(trained(ids))
        torch.testing.assert_close(merged.logits(merged(ids)), want, rtol=0, atol=1e-4)
        dequantize_model(trained)
        torch.testing.assert_close(trained.logits(trained(ids)), want, rtol=0, atol=1e-5)


def test_plan_counts_quantized_bytes_and_the_workspace(tiny_model_dir, monkeypatch):
    from hivetune.core.config import load_config
    from hivetune.model.quant import linear_shapes, nf4_bytes
    from hivetune.plan.memory import GIB
    from hivetune.plan.planner import plan
    from hivetune.workflows.workloads import qwen25_shape

    args = qwen25_shape(152064, 3584, 18944, 28, 28, 4, False)  # W2's shape
    parts = {}
    for quant in ("none", "nf4", "int8"):
        cfg = load_config(None, {"model": str(tiny_model_dir), "base_quant": quant, "precision": "bf16"})
        planned = plan(cfg, gpu="H200", model_args=args)
        assert planned.peak_gib == pytest.approx(sum(planned.parts_gib.values()), rel=1e-12)  # workspace included
        parts[quant] = planned.parts_gib
    linears = [o * i for o, i in linear_shapes(args)]
    dense = 28 * sum(linears) * 2
    assert parts["nf4"]["base weights"] * GIB == pytest.approx(
        parts["none"]["base weights"] * GIB - dense + 28 * sum(nf4_bytes(n) for n in linears), abs=1)
    assert parts["int8"]["base weights"] * GIB == pytest.approx(
        parts["none"]["base weights"] * GIB - dense + 28 * sum(n + 4 * o for n, (o, _) in zip(linears, linear_shapes(args))),
        abs=1)
    # gate/up joined in bf16 (Triton's NF4 dequantization writes it directly; int8's fp32 values besides)
    assert parts["nf4"]["dequantization workspace"] * GIB == 2 * 2 * 18944 * 3584
    assert parts["int8"]["dequantization workspace"] * GIB == (2 * 2 + 4) * 18944 * 3584
    assert "dequantization workspace" not in parts["none"]
    cfg = load_config(None, {"model": str(tiny_model_dir), "base_quant": "nf4", "precision": "bf16",
                             "gradient_checkpointing": True})
    held = plan(cfg, gpu="H200", model_args=args).parts_gib["dequantization workspace"]
    assert held * GIB == 2 * sum(linears)  # the recomputed layer keeps its groups' weights for backward
    monkeypatch.setenv("HIVETUNE_REFERENCE", "fused_lora")  # layer by layer: the largest weight alone
    alone = plan(cfg, gpu="H200", model_args=args).parts_gib["dequantization workspace"]
    assert alone * GIB == 2 * 18944 * 3584
    assert 5.0 < parts["nf4"]["base weights"] < 5.3  # 7.6B: 3.1 GiB of NF4 linears + 2 GiB of embeddings


def test_gradient_checkpointing_on_a_quantized_base_gives_the_same_adapter(tiny_model_dir, data, tmp_path):
    from hivetune.model.lora import lora_state_dict

    adapters = []
    for ckpt in (False, True):
        run = setup(run_cfg(tiny_model_dir, data, tmp_path / f"run-{ckpt}", base_quant="nf4", max_steps=3,
                            save_every=0, lora={"r": 4, "alpha": 8, "dropout": 0.0}, gradient_checkpointing=ckpt))
        fit(run, progress=False)
        adapters.append(lora_state_dict(run.model))
    for key in adapters[0]:
        torch.testing.assert_close(adapters[1][key], adapters[0][key], rtol=0, atol=1e-6)


def test_adapter_loads_in_peft_on_the_dequantized_base(reference, tiny_model_dir):
    """transformers' model with each linear weight replaced by the dequantized one, plus the
    adapter through peft.PeftModel: logits equal hivetune's on the quantized base."""
    import peft
    from transformers import AutoModelForCausalLM

    quant, _, _, out = reference
    ours = load_model(tiny_model_dir, base_quant=quant)
    load_adapter(ours, out / "adapter")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        for name, module in ours.named_modules():
            if isinstance(module, QuantLinear):
                hf.get_submodule(name.removesuffix(".base_layer")).weight.copy_(module.dequantized())
    tuned = peft.PeftModel.from_pretrained(hf, str(out / "adapter")).eval()
    ids = torch.randint(3, 384, (2, 19), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(tuned(ids).logits, ours.eval().logits(ours(ids)), rtol=0, atol=1e-4)


def test_generate_and_eval_load_the_base_the_adapter_trained_on(reference, tiny_model_dir, tmp_path):
    from hivetune.workflows.evaluate import evaluate
    from hivetune.workflows.generate import load_for_generation

    quant, _, _, out = reference
    net, _ = load_for_generation(str(tiny_model_dir), str(out), device="cpu", precision="fp32")
    assert isinstance(net.model.layers[0].mlp.down_proj.base_layer, QuantLinear)
    assert net.model.layers[0].mlp.down_proj.base_layer.fmt == quant
    plain, _ = load_for_generation(str(tiny_model_dir), "", device="cpu", precision="fp32")
    assert not is_quantized(plain)
    data = write_jsonl(tmp_path / "heldout.jsonl", ops_records(3))
    report = evaluate(adapter=str(out), model=str(tiny_model_dir), data=str(data), out=str(tmp_path / "eval"),
                      device="cpu", precision="fp32", max_new_tokens=4)
    assert report["examples"] == 3


def test_fsdp_on_a_quantized_base_is_refused(tiny_model_dir, data, tmp_path):
    from hivetune.core.errors import UserError
    from hivetune.parallel.distributed import Dist
    from hivetune.train.setup import assemble

    cfg = run_cfg(tiny_model_dir, data, tmp_path / "run", base_quant="nf4", distributed="fsdp")
    model = load_model(tiny_model_dir, base_quant="nf4")
    with pytest.raises(UserError) as e:
        assemble(cfg, model, None, None, torch.device("cpu"), "fp32", tmp_path / "run", tiny_model_dir,
                 Dist(rank=0, world=2))
    assert str(e.value) == ("distributed: fsdp does not shard a quantized base (base_quant nf4: its weights are "
                            "buffers of packed blocks); use ddp or auto, or base_quant none")
