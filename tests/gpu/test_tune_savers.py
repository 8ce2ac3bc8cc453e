"""`hivetune tune`'s memory savers on a real GPU (workflows.tune.memory_savers; the choice and the
tune.yaml plumbing are CPU-tested in tests/workflows/test_tune.py): a micro-batch over the cap as
it is gets one row with the fewest first layers checkpointed (CUDA graphs on) and one with the
fewest layers offloaded (eager), and each row really trains that way within the cap.

The model (hidden 512, 8 layers, untied, bf16) with 2 examples of 2,048 tokens a micro-batch is
activation-bound and launch-bound (graphed as it is). The cap lies between the planner's peak
for the micro-batch as it is and the savers' peaks, so the plain row is skipped unmeasured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hivetune.core.config import load_config
from hivetune.model.load import load_args
from hivetune.plan.memory import GIB, breakdown
from hivetune.workflows import tune as tune_module

from conftest import build_tiny_model, build_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTH, LAYERS = 2048, 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tune-savers-model")
    build_tokenizer(folder)
    build_tiny_model(folder, hidden_size=512, intermediate_size=2048, num_hidden_layers=LAYERS,
                     num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                     max_position_embeddings=LENGTH)
    return folder


def test_tune_times_each_saver_as_it_says(model, monkeypatch):
    cfg = load_config(None, {"model": str(model), "device": "cuda", "precision": "bf16", "batch_size": 2,
                             "grad_accum": 1, "max_length": LENGTH, "lora_inputs": "recompute",
                             "lora": {"r": 8, "alpha": 16, "dropout": 0.05}})
    args = load_args(model)
    tokens = 2 * LENGTH
    # the plain row's prediction as tune makes it (lora_inputs pinned: nothing resolved by the cap)
    mc, _ = tune_module._candidate_memory(cfg, args, "bf16", False, True, tokens, 0)
    plain = breakdown(args, mc, tokens).total
    savers = tune_module.memory_savers(cfg, args, "bf16", tokens, int(plain - 0.05 * GIB), True)
    assert len(savers) == 2, savers
    cap_gib = (plain + max(peak for _, peak in savers)) / 2 / GIB

    from hivetune.train import loop as train_loop

    ran = []
    real_fit = train_loop.fit

    def fit(run, **kw):
        result = real_fit(run, **kw)
        offload = run.model.activation_offload
        ran.append((run.model.checkpointed_layers(), offload.stats["passes"] if offload else 0))
        return result

    monkeypatch.setattr(train_loop, "fit", fit)
    result = tune_module.tune(cfg, batch_sizes=[2], steps=2, length=LENGTH, cap_gib=cap_gib, out=None,
                              attention=["varlen"])
    rows = [(r.gradient_checkpointing, r.saver, r.status) for r in result.rows]
    print(tune_module.format_tune(result))
    ckpt, offload = (changes for changes, _ in tune_module.memory_savers(cfg, args, "bf16", tokens,
                                                                           int(cap_gib * GIB), True))
    assert rows[:3] == [(False, {}, "over cap (predicted)"), (True, ckpt, "ok"), (False, offload, "ok")], rows
    assert ckpt["gradient_checkpointing"] and 0 < ckpt["checkpoint_layers"] < LAYERS
    # 4,096 tokens of this model are graphed as they are: the offload row runs eager
    assert offload["host_embeddings"] and offload["cuda_graphs"] is False
    assert 0 < offload["activation_offload"] <= LAYERS // 2
    # what each timed run did: its checkpointed layers, its offloaded micro-batches
    assert ran[0] == (ckpt["checkpoint_layers"], 0) and ran[1][0] == 0 and ran[1][1] > 0, ran
    assert all(r.peak_gib <= cap_gib for r in result.rows[1:3])
