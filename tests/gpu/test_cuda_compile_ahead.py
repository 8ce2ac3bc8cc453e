"""ops.compile_ahead on a GPU, each run a fresh process with its own Triton cache: the first pass's
missing kernels compiled by the workers leave the real pass nothing to compile, and the run's
losses are those of a run that compiled at each launch; a warm cache starts no workers; a cache
warm from another model's run still lets the twin find this model's new kernels early; a run whose
micro-batches are too large for CUDA graphs (eager steps through train.replay) finds them early too,
and so does one with host_embeddings, whose twin reads its table on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPT = """
import json, sys
from hivetune.core.config import load_config
from hivetune.ops import compile_ahead
from hivetune.train.loop import fit
from hivetune.plan import graph_sizes
from hivetune.train import replay
from hivetune.train.setup import setup
model, data, out, workers, eager, extra = sys.argv[1:7]
if eager == "compute-bound":  # every micro-batch over the cut-off: replay's eager calls
    graph_sizes.MAX_TFLOP_PER_MICRO_BATCH = 0.0
values = {"model": model, "data": data, "output_dir": out, "eval_prompts": 0, "device": "cuda",
          "precision": "bf16", "batch_size": 4, "max_steps": 4, "lr": 5e-3, "warmup_steps": 0,
          "lora": {"r": 4, "alpha": 8, "dropout": 0.1}, "compile_workers": int(workers), **json.loads(extra)}
run = setup(load_config(None, values))
fit(run, progress=False)
losses = [json.loads(line)["loss"] for line in open(out + "/metrics.jsonl")]
off = replay.last_stats["off"] if replay.last_stats else None
embed = type(run.model.model.embed_tokens).__name__
print(json.dumps({"stats": compile_ahead.STATS, "losses": losses, "graphs_off": off, "embed": embed}))
"""


def train(model_dir, data, out: Path, workers: int, cache: Path, eager: str = "", **extra) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), str(data), str(out), str(workers), eager,
                           json.dumps(extra)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_compiled_ahead_leave_the_real_pass_nothing_and_the_losses_unchanged(
        tiny_model_dir, tiny_gemma2_dir, alpaca_file, tmp_path):
    ahead = train(tiny_model_dir, alpaca_file, tmp_path / "ahead", 4, tmp_path / "cache-ahead")
    plain = train(tiny_model_dir, alpaca_file, tmp_path / "plain", 0, tmp_path / "cache-plain")
    stats = ahead["stats"]
    assert stats["kernels"] >= 5 and stats["errors"] == [] and stats["missed"] == 0, stats
    assert stats["workers_started_early"] is True  # an empty cache has no marker
    # the twin (train.twin) met them all before the weights loaded: the first pass found no new one
    assert stats["early"]["kernels"] == stats["kernels"] and "error" not in stats["early"], stats
    assert plain["stats"] is None  # compile_workers: 0
    assert ahead["losses"][0] == plain["losses"][0]  # the discovery pass left no trace in the first step
    assert ahead["losses"] == pytest.approx(plain["losses"], rel=1e-3)
    assert len(list((tmp_path / "cache-ahead").glob("hivetune-*.warm"))) == 2  # hivetune's, the model's

    again = train(tiny_model_dir, alpaca_file, tmp_path / "again", 4, tmp_path / "cache-ahead")
    assert {k: again["stats"][k] for k in ("kernels", "workers_started_early", "early")} == {
        "kernels": 0, "workers_started_early": False, "early": None}
    assert again["losses"][0] == ahead["losses"][0]

    # another model on that cache: its marker missing, the twin meets its new kernels before its
    # weights load (the workers start then), and its first pass leaves its marker
    other = train(tiny_gemma2_dir, alpaca_file, tmp_path / "other", 4, tmp_path / "cache-ahead")["stats"]
    assert other["kernels"] >= 1 and other["workers_started_early"] is False, other
    assert other["early"]["kernels"] == other["kernels"] and other["missed"] == 0 and other["errors"] == [], other
    assert len(list((tmp_path / "cache-ahead").glob("hivetune-*.warm"))) == 3


def test_compute_bound_eager_steps_find_their_kernels_early(alpaca_file, tmp_path):
    """Hidden 2,048 takes the in-matmul dropout kernels; replay's eager calls add A's gradient into
    the persistent arena (the accumulating specialisation), and the twin must meet that one too."""
    from conftest import build_tiny_model, build_tokenizer

    folder = tmp_path / "wide"
    build_tokenizer(folder)
    build_tiny_model(folder, hidden_size=2048, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=8)
    ran = train(folder, alpaca_file, tmp_path / "out", 4, tmp_path / "cache", eager="compute-bound")
    stats = ran["stats"]
    assert ran["graphs_off"].startswith("compute-bound micro-batches"), ran
    assert stats["kernels"] >= 5 and stats["errors"] == [] and stats["missed"] == 0, stats
    assert stats["early"]["kernels"] == stats["kernels"], stats  # the first pass met no kernel the twin missed


def test_the_twin_reads_its_host_embedding_on_the_gpu_with_the_runs_kernel(alpaca_file, tmp_path):
    """host_embeddings: the twin's table stays on the GPU (no pinning), the run's goes to pinned host
    memory; the gather kernel's specialisation is the same, so the first pass meets none the twin
    did not."""
    from conftest import build_tiny_model, build_tokenizer

    folder = tmp_path / "untied"
    build_tokenizer(folder)
    build_tiny_model(folder, tie_word_embeddings=False)
    ran = train(folder, alpaca_file, tmp_path / "out", 4, tmp_path / "cache", host_embeddings=True)
    stats = ran["stats"]
    assert ran["embed"] == "HostEmbedding", ran
    assert stats["kernels"] >= 5 and stats["errors"] == [] and stats["missed"] == 0, stats
    assert stats["early"]["kernels"] == stats["kernels"], stats
