"""The planner: activation bytes against autograd's saved tensors, the seeds' fit questions,
the OOM fallback, auto_config and the CLI. Everything from config dicts; no weights."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from hivetune.workflows.workloads import qwen25_shape, random_model
from hivetune.cli import main
from hivetune.core.config import load_config
from hivetune.data.batch import collate_packed
from hivetune.data.formats import Encoded
from hivetune.model.lora import LoRASpec, apply_lora
from hivetune.plan import auto_config, plan, smaller_micro_batch
from hivetune.model.load import load_args
from hivetune.plan.measure import saved_activation_bytes, varlen_standin
from hivetune.plan.planner import checkpoint_to_fit, memory_config
from hivetune.plan.timing import flops_per_token
from hivetune.plan.memory import (GIB, MemoryConfig, activation_bytes, base_parameter_count, breakdown,
                                  largest_micro_batch)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QWEN25_3B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
             "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
             "tie_word_embeddings": True, "max_position_embeddings": 32768}
QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "tie_word_embeddings": False, "max_position_embeddings": 32768}


def write_config(tmp_path: Path, cfg: dict, name: str) -> Path:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(cfg))
    return path


def train_config(model: Path, **values):
    cfg = load_config(None, {"model": str(model), **values})
    if hasattr(cfg, "cuda_graphs"):
        cfg.cuda_graphs = False  # verdicts for the eager loop; graphs pad to 256-token buckets
    return cfg


# The training path: q/k/v and gate/up joined through ops.lora_group (lora.fuse_projections, every
# run but FSDP's); on a GPU in bf16 also the Triton RMSNorm / SwiGLU (their saved sets stood in on
# the CPU). The layer-by-layer path is what FSDP trains (and HIVETUNE_REFERENCE=fused_lora).
PATHS = ([(precision, path) for precision in ("fp32", "bf16") for path in ("layered", "joined")]
         + [("bf16", "triton"), ("bf16", "triton-keep")])  # keep: lora_inputs=keep


@pytest.mark.parametrize("precision, path", PATHS)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "down_proj")])
def test_activation_bytes_match_saved_tensors(precision, path, dropout, targets):
    """The per-token formula and the LoRA casts against the distinct storages autograd saves in
    a real forward pass (varlen attention's saved set stood in on the CPU). Dropout masks:
    layer by layer the CPU keeps one in the input dtype, CUDA a bool one (mask_bytes);
    lora_group's torch.native_dropout is bool on both."""
    from hivetune.model.lora import fuse_projections
    from hivetune.plan.measure import fused_layers_standin

    args = qwen25_shape(300, 64, 176, 3, 4, 2, False)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    model = random_model(args, "cpu", dtype)
    assert base_parameter_count(args) == sum(p.numel() for p in model.parameters())
    apply_lora(model, LoRASpec(8, 16, dropout, targets))
    if path != "layered":
        assert fuse_projections(model) == 2 * args.num_hidden_layers
        model.lora_casts.keep_inputs = path == "triton-keep"
    model.train()
    rng = random.Random(0)
    examples = [Encoded([rng.randrange(300) for _ in range(n)], [False] * (n // 3) + [True] * (n - n // 3), False)
                for n in (37, 60, 23)]
    batch = collate_packed(examples)
    if dropout and path != "layered":  # the joined path's mask: bool on the CPU too
        x = torch.ones(4, 64, dtype=dtype)
        assert torch.native_dropout(x, dropout, True)[1].dtype == torch.bool
    with varlen_standin(), (fused_layers_standin() if path.startswith("triton") else contextlib.nullcontext()):
        measured = saved_activation_bytes(model, batch, precision)
    mc = MemoryConfig(precision=precision, r=8, targets=targets, dropout=dropout,
                      mask_bytes=2 if precision == "bf16" else 4, joined=path != "layered",
                      fused_layers=path.startswith("triton"), keep_inputs=path == "triton-keep")
    predicted = activation_bytes(args, mc, batch.input_ids.shape[1], len(batch.target_ids))
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)


def test_lora_casts_of_the_joined_path():
    """A_all [n r, d] and the block-diagonal B [O, n r] of each group call, in the compute dtype
    (a lone layer's B only below fp32), for every layer, with checkpointing too (the recompute
    reads the forward's CastCache: lora_casts.SeedTape)."""
    from hivetune.plan.memory import lora_cast_bytes

    args = qwen25_shape(300, 64, 176, 3, 4, 2, False)  # q 64, k / v 32, intermediate 176
    r = 8
    qkv = 3 * r * 64 + 128 * 3 * r
    gate_up = 2 * r * 64 + 352 * 2 * r
    o, down = r * 64, r * 176  # A; B: 64 x r and 64 x r below fp32
    for precision, s in (("fp32", 4), ("bf16", 2)):
        lone_b = 0 if s == 4 else 64 * r
        per_layer = s * (qkv + gate_up + o + down + 2 * lone_b)
        mc = MemoryConfig(precision=precision, r=r)
        assert lora_cast_bytes(args, mc) == 3 * per_layer
        ckpt = MemoryConfig(precision=precision, r=r, gradient_checkpointing=True)
        assert lora_cast_bytes(args, ckpt) == 3 * per_layer
        qv = MemoryConfig(precision=precision, r=r, targets=("q_proj", "v_proj"))  # two lone layers
        assert lora_cast_bytes(args, qv) == 3 * s * (2 * r * 64 + (0 if s == 4 else (64 + 32) * r))


def test_each_layer_left_out_of_checkpointing_adds_its_saved_tensors():
    """checkpoint_layers c of L: c layer inputs and L - c layers' saved tensors (W2's shape)."""
    from hivetune.plan.memory import layer_saved_bytes_per_token

    args, tokens = qwen25_shape(152064, 3584, 18944, 28, 28, 4, False), 2912
    base = dict(precision="bf16", r=32, dropout=0.05, fused_layers=True, base_quant="nf4")
    every = breakdown(args, MemoryConfig(**base, gradient_checkpointing=True), tokens)
    assert breakdown(args, MemoryConfig(**base, gradient_checkpointing=True, checkpoint_layers=28), tokens).total == every.total
    per_layer = layer_saved_bytes_per_token(args, MemoryConfig(**base))
    for c in (27, 24, 1):
        part = breakdown(args, MemoryConfig(**base, gradient_checkpointing=True, checkpoint_layers=c), tokens)
        grown = part.parts["activations"] - every.parts["activations"]
        assert grown == pytest.approx((28 - c) * (per_layer - 2 * 3584) * tokens, abs=1)
    off = breakdown(args, MemoryConfig(**base), tokens)
    four_kept = breakdown(args, MemoryConfig(**base, gradient_checkpointing=True, checkpoint_layers=24), tokens)
    assert every.total < four_kept.total < off.total
    assert part.total > off.total  # one layer checkpointed: its recompute costs more than it saves


def test_training_path_follows_the_run(monkeypatch):
    """The planner predicts the path train takes: joined unless FSDP or the forced reference;
    the Triton RMSNorm / SwiGLU on a GPU in half precision unless forced off."""
    from hivetune.plan.planner import training_path

    monkeypatch.delenv("HIVETUNE_REFERENCE", raising=False)
    assert training_path("fp32", cuda=True) == {"joined": True, "fused_layers": False}
    assert training_path("bf16", cuda=False) == {"joined": True, "fused_layers": False}
    assert training_path("bf16", cuda=True, distributed="fsdp")["joined"] is False
    monkeypatch.setenv("HIVETUNE_REFERENCE", "fused_lora")
    assert training_path("bf16", cuda=True)["joined"] is False
    monkeypatch.setenv("HIVETUNE_REFERENCE", "fused_layers")
    assert training_path("bf16", cuda=True) == {"joined": True, "fused_layers": False}


def test_parameter_count_llama_and_qwen3():
    from hivetune.model.config import ModelArgs
    from hivetune.model.decoder import CausalLM

    for cfg in ({"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
                {"model_type": "qwen3", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "tie_word_embeddings": True}):
        args = ModelArgs.from_hf_dict(cfg)
        with torch.device("meta"):
            model = CausalLM(args)
        assert base_parameter_count(args) == sum(p.numel() for p in model.parameters())


def test_seed_qwen25_3b_fp32_on_mi50(tmp_path):
    """3B in fp32: 11.5 GiB of weights, ~8.6 MB of saved activations per token (sdpa path), so
    a 32 GB MI50 holds a micro-batch of about 2,100 tokens: one 1,024-token example fits, the
    default 8 x 1,024 (~84 GiB) does not, and with checkpointing (~0.3 MB a token) it does."""
    model = write_config(tmp_path, QWEN25_3B, "qwen2.5-3b")
    one = plan(train_config(model, precision="fp32", batch_size=1, max_length=1024), gpu="MI50")
    assert one.fits and 11.4 < one.parts_gib["base weights"] < 11.6
    eight = plan(train_config(model, precision="fp32", batch_size=8, max_length=1024), gpu="MI50")
    assert not eight.fits and eight.peak_gib > 70
    assert 1800 < eight.largest_micro_batch_tokens < 2500
    assert "gradient_checkpointing" in eight.suggestion
    ckpt = plan(train_config(model, precision="fp32", batch_size=8, max_length=1024,
                             gradient_checkpointing=True), gpu="MI50")
    assert ckpt.fits and ckpt.peak_gib < 20


@pytest.mark.parametrize("gpu, fits_2x1024", [("RTX 4090", False), ("Radeon AI PRO R9700", True)])
def test_seed_qwen25_7b_bf16_on_24_and_32_gb(tmp_path, gpu, fits_2x1024):
    """7B in bf16: 14.2 GiB of weights, ~4.5 MB a token saved (varlen attention, the Triton
    RMSNorm / SwiGLU): 24 GB leaves room for ~1,650 tokens a micro-batch, 32 GB for ~3,600;
    checkpointing makes 8 x 1,024 fit on both."""
    model = write_config(tmp_path, QWEN25_7B, "qwen2.5-7b")
    one = plan(train_config(model, precision="bf16", batch_size=1, max_length=1024), gpu=gpu)
    assert one.fits and 14.1 < one.parts_gib["base weights"] < 14.3
    two = plan(train_config(model, precision="bf16", batch_size=2, max_length=1024), gpu=gpu)
    assert two.fits is fits_2x1024
    eight = plan(train_config(model, precision="bf16", batch_size=8, max_length=1024), gpu=gpu)
    assert not eight.fits
    ckpt = plan(train_config(model, precision="bf16", batch_size=8, max_length=1024,
                             gradient_checkpointing=True), gpu=gpu)
    assert ckpt.fits
    assert [row["examples"] for row in ckpt.scaling] == [10_000, 50_000, 100_000]
    assert ckpt.scaling[2]["seconds"] == pytest.approx(10 * ckpt.scaling[0]["seconds"])


def test_largest_micro_batch_is_the_boundary():
    args = qwen25_shape(152064, 3584, 18944, 28, 28, 4, False)
    mc = MemoryConfig(precision="bf16", r=16)
    budget = 24 * GIB
    t = largest_micro_batch(args, mc, budget)
    assert breakdown(args, mc, t).total <= budget < breakdown(args, mc, t + 1).total


def test_smaller_micro_batch_keeps_the_effective_batch():
    cfg = load_config(None, {"model": "m", "batch_size": 8, "grad_accum": 1})
    steps = []
    while cfg is not None:
        steps.append((cfg.batch_size, cfg.grad_accum))
        cfg = smaller_micro_batch(cfg)
    assert steps == [(8, 1), (4, 2), (2, 4), (1, 8)]
    odd = smaller_micro_batch(load_config(None, {"model": "m", "batch_size": 6, "grad_accum": 2}))
    assert (odd.batch_size, odd.grad_accum) == (3, 4)
    assert smaller_micro_batch(load_config(None, {"model": "m", "batch_size": 3})).batch_size == 1
    assert smaller_micro_batch(load_config(None, {"model": "m", "batch_size": 1})) is None


def test_auto_config_fits_and_keeps_the_effective_batch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = write_config(tmp_path, QWEN25_7B, "qwen2.5-7b")
    cfg = train_config(model, precision="bf16", batch_size=8, grad_accum=2, max_length=1024)
    new, why = auto_config(cfg, "cpu", memory_gib=31.9)
    assert (new.batch_size, new.grad_accum, new.gradient_checkpointing) == (2, 8, False), why
    assert "predicted peak" in why
    one, why = auto_config(cfg, "cpu", memory_gib=23.6)  # 24 GB: one 1,024-token example, no checkpointing
    assert (one.batch_size, one.grad_accum, one.gradient_checkpointing) == (1, 16, False), why
    # no micro-batch fits as it is: the largest that fits with the input embedding in host memory
    # and the fewest offloaded layers (at most half of them) comes before checkpointing
    tight, why = auto_config(cfg, "cpu", memory_gib=20)
    assert (tight.batch_size, tight.grad_accum, tight.gradient_checkpointing) == (2, 8, False), why
    assert tight.host_embeddings and tight.activation_offload == 13 and "activation_offload=13" in why, why
    for layers, fits in ((13, True), (12, False)):
        mc = memory_config(dataclasses.replace(tight, activation_offload=layers), "bf16", False)
        assert (breakdown(load_args(model), mc, 2 * 1024).total <= 20 * GIB) == fits
    graphed, why = auto_config(dataclasses.replace(cfg, cuda_graphs=True), "cpu", memory_gib=20)
    assert graphed.activation_offload == 13 and not graphed.cuda_graphs and "CUDA graphs off" in why, why
    tighter, why = auto_config(cfg, "cpu", memory_gib=17)  # offload would need more than 14 of 28 layers
    assert (tighter.batch_size, tighter.gradient_checkpointing, tighter.activation_offload) == (2, True, 0), why
    assert not tighter.host_embeddings
    sharded, why = auto_config(dataclasses.replace(cfg, distributed="fsdp"), "cpu", memory_gib=20)
    assert sharded.gradient_checkpointing and not sharded.activation_offload, why  # FSDP: no offload
    asked, why = auto_config(dataclasses.replace(cfg, activation_offload=3), "cpu", memory_gib=20)
    assert (asked.batch_size, asked.activation_offload, asked.host_embeddings) == (1, 3, False), why
    (tmp_path / "tune.yaml").write_text("batch_size: 4\ngrad_accum: 1\ngradient_checkpointing: true\n")
    tuned, why = auto_config(cfg, "cpu", memory_gib=31.9)
    assert (tuned.batch_size, tuned.grad_accum, tuned.gradient_checkpointing) == (4, 4, True)
    assert "tune.yaml" in why and tuned.lora_inputs == "auto"
    # lora_inputs as tune resolved it for that candidate, where the config leaves it to auto
    (tmp_path / "tune.yaml").write_text("batch_size: 4\ngrad_accum: 1\ngradient_checkpointing: false\n"
                                        "lora_inputs: keep\n")
    tuned, why = auto_config(cfg, "cpu", memory_gib=31.9)
    assert (tuned.batch_size, tuned.lora_inputs) == (4, "keep") and "lora_inputs keep" in why, why
    asked, why = auto_config(dataclasses.replace(cfg, lora_inputs="recompute"), "cpu", memory_gib=31.9)
    assert asked.lora_inputs == "recompute" and "lora_inputs" not in why, why
    unchanged, why = auto_config(cfg, "cpu", tune_file=tmp_path / "none.yaml")
    assert unchanged is cfg and "CPU" in why


def chunk_storages_peak(fn, size: int) -> int:
    """The most bytes of CPU storages of exactly `size` bytes alive at once while fn() runs
    (torch profiler's memory timeline: every allocation, those inside an op's kernel too)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    alive = peak = 0
    for _, action, _, nbytes in prof._memory_profile().timeline:
        if nbytes == size and action in (Action.CREATE, Action.DESTROY):
            alive += nbytes if action == Action.CREATE else -nbytes
            peak = max(peak, alive)
    return peak


@pytest.mark.parametrize("capped", [False, True])
def test_loss_chunk_bytes_are_what_the_pytorch_chunk_holds(tiny_gemma2_dir, capped):
    """The plan's [chunk, vocab] buffers of the fused loss on the PyTorch chunk (fused_layers off)
    against the fp32 chunk-size storages alive at once in the loss of a tiny Gemma 2, over 4
    chunks of 5 rows, with its final logit cap and without: 2 chunks of 5 x 384 fp32 logits either
    way (the logits and logsumexp's x - max; the previous chunk's gradient is freed first)."""
    from hivetune.ops.fused_ce import fused_target_loss_sum
    from hivetune.plan.memory import loss_chunk_bytes

    args = load_args(tiny_gemma2_dir)
    assert (args.vocab_size, args.hidden_size, args.final_logit_softcapping) == (384, 64, 3.0)
    n, chunk_bytes = 20, 5 * 384 * 4
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n, 64, generator=gen).requires_grad_()
    weight = torch.randn(384, 64, generator=gen) * 0.2
    ids = torch.randint(0, 384, (n,), generator=gen)
    cap = args.final_logit_softcapping if capped else None
    measured = chunk_storages_peak(
        lambda: fused_target_loss_sum(hidden, weight, torch.arange(n), ids, chunk_bytes=chunk_bytes, softcap=cap),
        chunk_bytes)
    planned = loss_chunk_bytes(args, MemoryConfig(precision="fp32"), n, chunk_bytes)
    assert (measured, planned) == (15360, 15360)


def test_timing_constants_match_the_h200_grid():
    from hivetune.plan import timing
    grid = Path(__file__).parents[2] / "benchmarks" / "results" / "plan-grid-h200.json"
    cal = timing.calibrate(grid, {"bf16": 989.0, "fp32": 67.0})
    assert cal["efficiency"]["bf16"] == pytest.approx(timing.EFFICIENCY["bf16"], rel=0.1)
    assert cal["efficiency"]["fp32"] == pytest.approx(timing.EFFICIENCY["fp32"], rel=0.1)
    assert cal["dispatch_s_per_layer"] == pytest.approx(timing.DISPATCH_S_PER_LAYER, rel=0.1)


def test_memory_plan_replays_the_h200_grid(monkeypatch):
    """Each measured point of the recorded H200 grid, planned now as train resolves its config
    (lora_inputs auto against the device's memory, varlen as the device had it): the predicted
    peak within 10% of the peak reserved measured there."""
    import importlib.util

    from hivetune.ops import attention
    from hivetune.plan.gpus import find_gpu

    root = Path(__file__).parents[2]
    spec = importlib.util.spec_from_file_location("plan_grid", root / "benchmarks" / "plan_grid.py")
    plan_grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_grid)
    record = json.loads((root / "benchmarks" / "results" / "plan-grid-h200.json").read_text())
    env = record["environment"]
    memory = env.get("device_memory_bytes") or int(find_gpu(env["gpu"]).memory_gib * GIB)
    errors, kept = {}, set()
    for pt in record["points"]:
        if not (m := pt.get("measured")):
            continue
        monkeypatch.setattr(attention, "_varlen_fn", lambda m=m: (object() if m["varlen"] else None, True,
                                                                   m["varlen_gqa"]))
        predicted = plan_grid.predict(pt["point"], memory)
        key = (pt["index"], pt["point"]["cuda_graphs"])
        errors[key] = round(predicted["predicted_reserved_bytes"] / m["max_memory_reserved"] - 1, 3)
        if predicted["path"]["keep_inputs"]:
            kept.add(key)
    assert len(errors) == 25
    assert kept == {(5, True), (5, False), (11, True), (11, False), (16, False)}  # the bf16 points with dropout
    assert max(abs(e) for e in errors.values()) <= 0.10, errors


def test_plan_cli_json_and_errors(tmp_path, capsys):
    model = write_config(tmp_path, QWEN25_7B, "qwen2.5-7b")
    assert main(["plan", "--model", str(model), "--gpu", "RTX 4090", "--batch-size", "8",
                 "--max-length", "1024", "--precision", "bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["gpu"] == "RTX 4090" and out["memory_gib"] == 23.6
    assert out["parts_gib"]["activations"] > 30
    assert main(["plan", "--model", str(model), "--gpu", "TPU v9"]) == 2
    assert "--gpu: unknown GPU 'TPU v9'" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / "nothing"), "--memory", "24"]) == 2
    assert "model path not found" in capsys.readouterr().err
    assert main(["plan", "--model", str(model), "--memory", "24", "--max-length", "512"]) == 0
    text = capsys.readouterr().out
    assert "predicted peak" in text and "no rates for this GPU" in text


def test_plan_with_data_uses_real_lengths(tiny_model_dir, alpaca_file):
    from hivetune.data.dataset import index_dataset
    from hivetune.model.tokenizer import load_tokenizer

    cfg = train_config(tiny_model_dir, data=str(alpaca_file), batch_size=4, max_length=1024, precision="fp32")
    p = plan(cfg, gpu="H100")
    lengths = index_dataset(alpaca_file, "auto", load_tokenizer(str(tiny_model_dir)), 1024, False).lengths
    assert p.examples == len(lengths) and p.tokens_per_epoch == sum(lengths)
    assert p.epoch_seconds == pytest.approx(len(lengths) / 4 * p.step_seconds)


@pytest.mark.parametrize("values", [{"batch_size": 4}, {"batch_size": 2, "grad_accum": 3},
                                    {"batch_size": 3, "packing": False}, {"batch_size": 4, "batch_order": "random"}])
def test_plan_sizes_the_largest_micro_batch_the_run_takes(tiny_model_dir, alpaca_file, tmp_path, values):
    """The run's own steps (its order, its split of a step into micro-batches), not the
    batch_size longest examples together: under the balanced default those never meet."""
    from hivetune.data.dataset import index_dataset
    from hivetune.model.tokenizer import load_tokenizer
    from hivetune.train.setup import setup
    from hivetune.train.step import micro_parts

    cfg = train_config(tiny_model_dir, data=str(alpaca_file), max_length=1024, precision="fp32", epochs=2,
                       device="cpu", output_dir=str(tmp_path / "run"), eval_prompts=0, **values)
    run = setup(cfg)
    lengths = run.data.lengths
    pad = cfg.packing is False
    taken = max((len(part) * max(lengths[i] for i in part)) if pad else sum(lengths[i] for i in part)
                for ids in run.steps for part in micro_parts(run, ids))
    assert plan(cfg, gpu="H100").micro_batch_tokens == taken
    every = index_dataset(alpaca_file, "auto", load_tokenizer(str(tiny_model_dir)), 1024, False).lengths
    b = cfg.batch_size
    bound = b * max(every) if pad else sum(sorted(every, reverse=True)[:b])
    assert taken <= bound
    if not pad and "batch_order" not in values:  # packed in the balanced order: below the bound
        assert taken < bound


def test_train_auto_flag_reports_its_choice(tiny_model_dir, alpaca_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--auto", "--quiet", "--model", str(tiny_model_dir), "--data", str(alpaca_file),
                 "--device", "cpu", "--precision", "fp32", "--max-steps", "1", "--batch-size", "2",
                 "--output", str(tmp_path / "run"), "--set", "eval_prompts=0"]) == 0
    assert "auto: CPU run, config unchanged" in capsys.readouterr().err
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()


def test_plan_with_activation_offload(tmp_path):
    """activation_offload moves the first N layers' large saved tensors to a host row outside
    the peak; CUDA-graphed micro-batches skip it, so there the planner counts none (a note)."""
    from hivetune.plan.planner import format_plan

    model = write_config(tmp_path, QWEN25_7B, "qwen2.5-7b")
    base = {"precision": "bf16", "batch_size": 4, "max_length": 1024}
    plain = plan(train_config(model, **base), gpu="RTX 4090")
    off = plan(train_config(model, activation_offload=8, **base), gpu="RTX 4090")
    host = off.host_gib["pinned host (offload)"]
    assert off.activation_offload == 8 and plain.host_gib == {} and 4.5 < host < 5  # ~150 KB a token a layer
    assert plain.parts_gib["activations"] - off.parts_gib["activations"] == pytest.approx(host)
    assert off.peak_gib < plain.peak_gib - 4.5 and off.largest_micro_batch_tokens > plain.largest_micro_batch_tokens
    assert "pinned host (offload)" in format_plan(off) and "not in the peak" in format_plan(off)
    graphed_cfg = train_config(model, activation_offload=8, **{**base, "batch_size": 1})
    graphed_cfg.cuda_graphs = True  # 1,024 tokens: graphed (not compute-bound), so no offload
    graphed = plan(graphed_cfg, gpu="RTX 4090")
    assert graphed.cuda_graphs and graphed.activation_offload == 0 and graphed.host_gib == {}
    assert any("activation_offload does not apply here" in n for n in graphed.notes)


def test_plan_suggests_the_fewest_offloaded_layers_that_fit(tmp_path):
    """A micro-batch that does not fit: the suggestion names the smallest activation_offload with
    which it fits, and the plan with that many layers fits while one fewer does not."""
    import re

    model = write_config(tmp_path, QWEN25_7B, "qwen2.5-7b")
    base = {"precision": "bf16", "batch_size": 4, "max_length": 1024}
    tight = plan(train_config(model, **base), memory_gib=28)
    assert not tight.fits
    n = int(re.search(r"activation_offload=(\d+)", tight.suggestion).group(1))
    assert plan(train_config(model, activation_offload=n, **base), memory_gib=28).fits
    assert not plan(train_config(model, activation_offload=n - 1, **base), memory_gib=28).fits
    roomy = plan(train_config(model, **base), memory_gib=80)
    assert roomy.fits and "activation_offload" not in roomy.suggestion


def test_lora_inputs_auto_keeps_what_costs_at_most_a_gib():
    """lora_inputs auto: W1 (0.5B, 2,496 tokens) keeps the dropped inputs (~0.84 GiB more),
    W2 (7B, 3,426 tokens) recomputes them (~5.3 GiB more) unless the device's memory is known
    and the peak with them kept is at most 60% of it (an 80 GB card, not a 24 GB one), and
    never where that peak would not fit; keep / recompute are obeyed, and nothing is kept where
    nothing is recomputed (no seeded dropout: dropout 0, the CPU)."""
    from hivetune.workflows.workloads import WORKLOADS
    from hivetune.plan.memory import KEEP_INPUTS_MAX_BYTES, keep_inputs_extra_bytes, resolve_keep_inputs

    seeded = MemoryConfig(precision="bf16", r=8, dropout=0.05, fused_layers=True)
    w1, w2 = WORKLOADS["W1"].args, WORKLOADS["W2"].args
    extra_w1 = keep_inputs_extra_bytes(w1, seeded, 2496)
    h, inter = w1.hidden_size, w1.intermediate_size
    # q/k/v, o, gate/up: [T, h] each; down: [T, I]; less the first layer's norm input, which
    # only its recomputing q/k/v kept (the frozen embedding needs no gradient)
    assert extra_w1 == 24 * 2496 * 2 * (3 * h + inter) - 2496 * 2 * h
    assert extra_w1 <= KEEP_INPUTS_MAX_BYTES < keep_inputs_extra_bytes(w2, dataclasses.replace(seeded, r=32), 3426)
    assert resolve_keep_inputs("auto", w1, seeded, 2496)
    assert not resolve_keep_inputs("auto", w2, dataclasses.replace(seeded, r=32), 3426)
    assert resolve_keep_inputs("keep", w2, seeded, 3426) and not resolve_keep_inputs("recompute", w1, seeded, 2496)
    # auto on a device with room: W2's peak with the inputs kept within 60% of its memory
    w2_seeded = dataclasses.replace(seeded, r=32)
    kept_peak = breakdown(w2, dataclasses.replace(w2_seeded, keep_inputs=True), 3426).reserved
    assert resolve_keep_inputs("auto", w2, w2_seeded, 3426, memory_bytes=80 * 2**30)
    assert resolve_keep_inputs("auto", w2, w2_seeded, 3426, memory_bytes=int(kept_peak / 0.6) + 1)
    assert not resolve_keep_inputs("auto", w2, w2_seeded, 3426, memory_bytes=int(kept_peak / 0.6) - 2)
    assert not resolve_keep_inputs("auto", w2, w2_seeded, 3426, memory_bytes=24 * 2**30)
    assert not resolve_keep_inputs("recompute", w2, w2_seeded, 3426, memory_bytes=80 * 2**30)
    # ... and never where the kept peak would not fit, though it costs under 1 GiB (W1: 3.79 GiB
    # predicted with them kept: it keeps under its 4 GiB cap, recomputes under 3.5)
    w1_kept = breakdown(w1, dataclasses.replace(seeded, keep_inputs=True), 2496).reserved
    assert 3.5 * 2**30 < w1_kept < 4 * 2**30
    assert resolve_keep_inputs("auto", w1, seeded, 2496, memory_bytes=4 * 2**30)
    assert not resolve_keep_inputs("auto", w1, seeded, 2496, memory_bytes=int(3.5 * 2**30))
    assert resolve_keep_inputs("keep", w1, seeded, 2496, memory_bytes=int(3.5 * 2**30))  # asked: obeyed
    for unseeded in (dataclasses.replace(seeded, dropout=0.0), dataclasses.replace(seeded, fused_layers=False)):
        assert keep_inputs_extra_bytes(w1, unseeded, 2496) == 0 and not resolve_keep_inputs("keep", w1, unseeded, 2496)


def test_plan_keeps_the_lora_inputs_where_the_gpu_has_room_and_sizes_by_recomputing(tmp_path):
    """hivetune plan resolves lora_inputs auto as train does: a 7B run of 16 x 256 tokens keeps
    the dropped inputs on an 80 GiB GPU (a higher peak than recomputing, and a note) and
    recomputes them on a 24 GiB one; the largest micro-batch is sized recomputing (auto would
    recompute there), the same as with lora_inputs=recompute."""
    model = write_config(tmp_path, QWEN25_7B, "qwen2.5-7b")
    base = {"precision": "bf16", "batch_size": 16, "max_length": 256, "lora": {"r": 32, "dropout": 0.05}}
    auto, recompute = (plan(train_config(model, lora_inputs=mode, **base), memory_gib=80)
                       for mode in ("auto", "recompute"))
    assert auto.peak_gib > recompute.peak_gib + 5 and any("keep their dropped inputs" in n for n in auto.notes)
    assert auto.largest_micro_batch_tokens == recompute.largest_micro_batch_tokens
    small = plan(train_config(model, **base), memory_gib=24)
    assert small.peak_gib == plan(train_config(model, lora_inputs="recompute", **base), memory_gib=24).peak_gib


def test_host_embeddings_move_the_untied_table_out_of_gpu_memory():
    """host_embeddings: the untied input embedding (W2: 152,064 x 3,584 bf16) leaves the GPU's
    base weights for pinned host memory; a tied table (W1: the LM head reads it) stays."""
    from hivetune.workflows.workloads import WORKLOADS

    mc = MemoryConfig(precision="bf16", r=32)
    moved = dataclasses.replace(mc, host_embeddings=True)
    w1, w2 = WORKLOADS["W1"].args, WORKLOADS["W2"].args
    table = 152064 * 3584 * 2
    a, b = breakdown(w2, mc, 3000), breakdown(w2, moved, 3000)
    assert a.parts["base weights"] - b.parts["base weights"] == table
    assert b.host["pinned host (embeddings)"] == table and "pinned host (embeddings)" not in a.host
    assert breakdown(w1, moved, 2000).parts == breakdown(w1, mc, 2000).parts


def test_plan_suggests_host_embeddings_where_they_are_untied(tmp_path):
    model = write_config(tmp_path, QWEN25_7B, "q7")
    cfg = train_config(model.parent, batch_size=16, max_length=256, precision="bf16")
    p = plan(cfg, memory_gib=20)
    assert not p.fits and p.suggestion.endswith(
        "; and with any of these, host_embeddings=true (the input embedding in pinned host memory: 1.02 GiB less)")
    moved = plan(dataclasses.replace(cfg, host_embeddings=True), memory_gib=20)
    assert "host_embeddings" not in moved.suggestion
    assert p.parts_gib["base weights"] - moved.parts_gib["base weights"] == pytest.approx(152064 * 3584 * 2 / 2**30)


def test_partial_checkpointing_fits_graphed_and_costs_its_share_of_the_recompute(tmp_path):
    """7B in bf16 on a 24 GB card, 3 x 1,024 tokens, CUDA graphs: too big as it is, and eager (~87 TFLOP); the plan
    names the fewest first layers to checkpoint (graphs stay on), that plan fits and one layer
    fewer does not, and its step costs 4N + 2N c / L matmul FLOPs a token, not checkpointing's 6N."""
    model = write_config(tmp_path, QWEN25_7B, "qwen2.5-7b")
    args = load_args(model)
    base = dict(precision="bf16", batch_size=3, max_length=1024, host_embeddings=True)

    def graphed(**values):
        return dataclasses.replace(train_config(model, **values), cuda_graphs=True)

    plain = plan(graphed(**base), gpu="RTX 4090")
    assert not plain.fits and not plain.cuda_graphs  # beyond the 60 TFLOP of plan.graph_sizes
    n = checkpoint_to_fit(args, graphed(**base), "bf16", 3072, 1.0, int(plain.memory_gib * GIB))
    assert 0 < n < 28
    assert f"gradient_checkpointing=true, checkpoint_layers={n} (the first {n} layers" in plain.suggestion
    fit = plan(graphed(**base, gradient_checkpointing=True, checkpoint_layers=n), gpu="RTX 4090")
    short = plan(graphed(**base, gradient_checkpointing=True, checkpoint_layers=n - 1), gpu="RTX 4090")
    assert fit.fits and fit.cuda_graphs and not short.fits
    every = plan(graphed(**base, gradient_checkpointing=True), gpu="H200")
    part = plan(graphed(**base, gradient_checkpointing=True, checkpoint_layers=n), gpu="H200")
    none = plan(graphed(**base), gpu="H200")
    n_w = args.linear_weight_count
    attention = 2 * args.num_attention_heads * args.head_dim * 1024 * args.num_hidden_layers
    share = n / 28
    assert flops_per_token(args, 1024, share) == pytest.approx((4 + 2 * share) * n_w + (3 + share) * attention, rel=1e-12)
    assert flops_per_token(args, 1024, True) == pytest.approx(6 * n_w + 4 * attention, rel=1e-12)
    compute = [p.step_seconds for p in (none, part, every)]  # all compute-bound on an H200
    assert compute[1] == pytest.approx(compute[0] + (compute[2] - compute[0]) * n / 28, rel=1e-9)
