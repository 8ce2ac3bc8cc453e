"""train.twin: the model cut to two layers with zero weights, made ready as the run's model, with
the run's step plan; its first micro-batch runs (on the CPU here; the GPU test with the compile
workers is tests/gpu/test_cuda_compile_ahead.py)."""

from __future__ import annotations

import dataclasses
import math

import torch

from hivetune.core.config import load_config
from hivetune.data.dataset import TokenizedExamples
from hivetune.model.config import qwen3_shape
from hivetune.model.decoder import CausalLM
from hivetune.model.lora import lora_parameters
from hivetune.ops.loss import target_loss_sum
from hivetune.train import step, twin
from hivetune.train.setup import assemble
from hivetune.workflows.workloads import workload_examples

ARGS = qwen3_shape(2048 + 512, 64, 128, 5, 4, 2, 16, True)  # the generator draws ids in [1000, vocab - 1000)


def config(**kw):
    values = {"model": "random", "data": "generator", "precision": "fp32", "device": "cpu", "batch_size": 4,
              "max_steps": 3, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "eval_prompts": 0, "seed": 3}
    values.update(kw)
    return load_config(None, values)


def test_the_twin_is_the_architecture_cut_to_two_layers():
    args = dataclasses.replace(ARGS, sliding_window=32,
                               layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"])
    cut = twin.twin_args(args)
    assert cut.num_hidden_layers == 2 and cut.layer_types == ["sliding_attention", "full_attention"]
    assert dataclasses.replace(cut, num_hidden_layers=5, layer_types=args.layer_types) == args
    assert twin.twin_args(dataclasses.replace(ARGS, num_hidden_layers=1)).num_hidden_layers == 1
    model = twin.twin_model(cut, torch.bfloat16, torch.device("cpu"))
    with torch.device("meta"):
        names = {n: p.shape for n, p in CausalLM(cut).named_parameters()}
    got = dict(model.named_parameters())
    assert {n: p.shape for n, p in got.items()} == names
    assert all(p.dtype == torch.bfloat16 and not p.any() for p in got.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as a loaded model is


def test_the_twins_run_has_the_runs_plan_and_its_first_step_computes(tmp_path):
    """The same step plan as assemble makes for the whole model; LoRA on the twin's two layers; its
    first micro-batch through the loop's forward and backward gives ln(vocab): zero weights, zero
    logits."""
    data = TokenizedExamples(workload_examples(40, ARGS.vocab_size))
    cfg = config()
    run = twin.twin_run(cfg, ARGS, data, torch.device("cpu"), "fp32", None)
    torch.manual_seed(0)
    real = assemble(cfg, CausalLM(ARGS), data, None, torch.device("cpu"), "fp32", tmp_path / "run", tmp_path)
    assert run.steps == real.steps and run.train_examples == real.train_examples
    assert len(lora_parameters(run.model)) * 5 == len(lora_parameters(real.model)) * 2
    assert run.model.activation_offload is None
    ids = run.steps[0]
    batch = next(step.micro_batches(run, ids, 0, 0))
    n_targets = sum(data.n_targets[i] for i in ids)
    # fp32: the loop's first call is eager
    assert not twin.graphed(run, ARGS, batch, twin.through_replay(run, target_loss_sum))
    loss = twin.first_call(run, ARGS, batch, n_targets, target_loss_sum)()
    assert math.isclose(loss.item(), math.log(ARGS.vocab_size), rel_tol=1e-6)
    assert all(p.grad is not None for p in lora_parameters(run.model) if p.requires_grad)


def test_nothing_runs_off_the_gpu_or_for_preferences():
    data = TokenizedExamples(workload_examples(8, ARGS.vocab_size))
    state = torch.get_rng_state()
    assert twin.compile_early(config(), ARGS, data, torch.device("cpu"), "fp32") is None
    assert twin.compile_early(config(method="dpo"), ARGS, data, torch.device("cuda"), "bf16") is None
    assert torch.equal(torch.get_rng_state(), state)


def test_the_kernel_key_follows_what_picks_kernels():
    """Same key for another depth, schedule, seed or output folder; another for a wider model, a
    LoRA rank, the precision, the batch or the memory planned for."""
    key = twin.kernel_key(config(), ARGS, "bf16")
    assert key == twin.kernel_key(config(lr=1e-3, seed=9, max_steps=7, output_dir="elsewhere"),
                                  dataclasses.replace(ARGS, num_hidden_layers=9), "bf16")
    assert len({key, twin.kernel_key(config(), dataclasses.replace(ARGS, hidden_size=128), "bf16"),
                twin.kernel_key(config(lora={"r": 8, "alpha": 8, "dropout": 0.0}), ARGS, "bf16"),
                twin.kernel_key(config(), ARGS, "fp16"), twin.kernel_key(config(batch_size=8), ARGS, "bf16"),
                twin.kernel_key(config(), ARGS, "bf16", 24 << 30)}) == 6
    assert not twin.NOT_KERNELS - {f.name for f in dataclasses.fields(type(config()))}  # each a config key
