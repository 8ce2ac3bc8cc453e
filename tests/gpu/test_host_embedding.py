"""host_embeddings (ops.host_embedding): the frozen input embedding in pinned host memory,
gathered over PCIe by a Triton kernel, against the table on the GPU."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from hivetune.workflows.workloads import qwen25_shape, random_model, workload_examples
from hivetune.core.config import load_config
from hivetune.data.dataset import TokenizedExamples
from hivetune.ops import lora_dropout, triton_util
from hivetune.train.loop import fit
from hivetune.train.setup import assemble

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")]

VOCAB = 32768


def test_gather_from_host_memory_equals_the_embedding():
    from hivetune.ops.host_embedding import HostEmbedding

    torch.manual_seed(0)
    embed = torch.nn.Embedding(VOCAB, 200).cuda().bfloat16()
    host = HostEmbedding(embed.weight)
    assert host.weight.device.type == "cpu" and host.weight.is_pinned() and not host.weight.requires_grad
    ids = torch.randint(0, VOCAB, (2, 777), device="cuda")
    assert torch.equal(host(ids), embed(ids))
    assert host(ids[:, :0]).shape == (2, 0, 200)
    # a twin's (train.twin): the table left on the GPU, the same kernel reading it
    twin = HostEmbedding(embed.weight, pinned=False)
    assert twin.weight.data_ptr() == embed.weight.data_ptr() and not twin.weight.requires_grad
    assert torch.equal(twin(ids), embed(ids))


def process_caches() -> int:
    """Bytes of the process-wide GPU caches made at their first use and kept (ops.blas's cuBLASLt
    workspace per stream, 32 MiB each; the split kernels' counters)."""
    from hivetune.ops import blas
    return sum(t.numel() * t.element_size() for t in (*blas._WORKSPACES.values(), *lora_dropout._COUNTERS.values()))


def losses_and_peak(tmp_path: Path, tie: bool, **cfg):
    """(logged losses, the GPU memory the model and run hold after setup, the input embedding's
    class). The memory is what setup added: the process-wide caches made at first use (cuBLASLt
    workspaces, the split kernels' counters) do not count, else a run's base would include what
    an earlier run's fit left there (16 MiB on an H200)."""
    gc.collect()  # an earlier run's model, if a cycle still holds it, goes before the count
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() - process_caches()
    args = qwen25_shape(VOCAB, 256, 512, 2, 8, 2, tie)
    model = random_model(args, "cuda", torch.bfloat16)
    examples = TokenizedExamples(workload_examples(32, VOCAB, cap=0, seed=5))
    values = {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda", "batch_size": 4,
              "max_steps": 6, "lr": 1e-3, "warmup_steps": 0, "eval_prompts": 0, "max_length": 4096,
              "cuda_graphs": False, "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, **cfg}
    run = assemble(load_config(None, values), model, examples, None, torch.device("cuda"), "bf16", tmp_path,
                   Path("random"))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() - process_caches() - before
    fit(run, progress=False)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return losses, base, type(run.model.model.embed_tokens).__name__


def test_training_with_the_table_in_host_memory(tmp_path, capsys):
    """Untied: the same loss curve, and the table's bytes no longer on the GPU. Tied: the table
    stays (the LM head reads it), with one line saying why."""
    want, on_gpu, kind = losses_and_peak(tmp_path / "a", tie=False)
    got, on_host, moved_kind = losses_and_peak(tmp_path / "b", tie=False, host_embeddings=True)
    assert kind == "Embedding" and moved_kind == "HostEmbedding"
    assert got == pytest.approx(want, rel=1e-3)
    assert on_gpu - on_host >= VOCAB * 256 * 2
    from hivetune.core import fallbacks
    fallbacks.NOTED.pop("host_embeddings", None)  # (its line is printed once a process)
    _, _, tied_kind = losses_and_peak(tmp_path / "c", tie=True, host_embeddings=True)
    assert tied_kind == "Embedding"
    assert "input embedding in host memory unavailable (the embedding is tied to the LM head" in capsys.readouterr().err
