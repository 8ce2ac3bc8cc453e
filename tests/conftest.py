"""Shared fixtures: a tiny byte-level BPE tokenizer with a ChatML template, tiny random models
saved in HF format, and small datasets. Everything is built locally in seconds; no hub."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "How do I restart the nginx service? Run systemctl restart nginx as root.",
    "Show the logs of sshd from the last hour with journalctl -u sshd --since '1 hour ago'.",
    "List GPUs with nvidia-smi and rocm-smi; check podman run --device nvidia.com/gpu=all.",
    "rpm-ostree status shows the deployments; bootc upgrade stages a new image.",
    "The quick brown fox jumps over the lazy dog 0123456789 ```code``` `inline`",
]

os.environ.setdefault("HIVETUNE_CACHE", str(Path(__file__).parent / ".cache"))


def build_tokenizer(folder: Path, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))


def build_tiny_model(folder: Path, model_type: str = "llama", vocab_size: int = 384, seed: int = 0, **overrides) -> None:
    """A 2-layer, hidden-64 random model of the given family, saved as HF safetensors."""
    import transformers

    cls_name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma2": "Gemma2"}[model_type]
    config_cls = getattr(transformers, f"{cls_name}Config")
    model_cls = getattr(transformers, f"{cls_name}ForCausalLM")
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    model.save_pretrained(str(folder))


@pytest.fixture(scope="session")
def llama_cpp():
    """The llama_cpp module; a test requests it before any slow setup, so a missing build skips first."""
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or an OSError from a broken shared library
        pytest.skip(f"llama-cpp-python cannot be imported ({type(e).__name__}: {e}); "
                    "`bash scripts/install_llama_cpp.sh` builds and installs it (about 9 minutes)")
    return llama_cpp


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tokenizer(folder)
    build_tiny_model(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory) -> Path:
    """A 2-layer Gemma 2 whose final logit cap binds: weights ~ N(0, 0.2) make logits of a few
    units, against final_logit_softcapping 3.0 (Gemma 2's is 30 on logits of tens)."""
    folder = tmp_path_factory.mktemp("tiny-gemma2")
    build_tokenizer(folder)
    build_tiny_model(folder, "gemma2", head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                     initializer_range=0.2, final_logit_softcapping=3.0)
    return folder


def tiny_config(model_dir: Path, data: Path, out: Path, **kw):
    """A small CPU training config (fp32, LoRA r=4, 3 steps of 4) with `kw` on top."""
    from hivetune.core.config import load_config

    values = {"model": str(model_dir), "data": str(data), "output_dir": str(out), "precision": "fp32",
              "device": "cpu", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "eval_prompts": 0,
              "batch_size": 4, "max_steps": 3, "lr": 1e-2, "warmup_steps": 0, "threads": 1}
    values.update(kw)
    return load_config(None, values)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def ops_records(n: int) -> list[dict]:
    services = ["nginx", "sshd", "redis", "podman", "httpd", "chronyd"]
    out = []
    for i in range(n):
        svc = services[i % len(services)]
        out.append({"instruction": f"How do I restart the {svc} service? ({i})", "input": "",
                    "output": f"Run `systemctl restart {svc}` as root, then `systemctl status {svc}`."})
    return out


@pytest.fixture
def alpaca_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", ops_records(24))


@pytest.fixture
def lora_model_and_batch():
    """GPU tests: (model, batch): 2 layers, hidden 256, LoRA r 8 on all 7 targets with weights ~ N(0, 0.02)
    (B nonzero, so every gradient path carries signal), 6 generator examples packed in one row."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hivetune.workflows.workloads import qwen25_shape, random_model, workload_examples
    from hivetune.data.batch import collate_packed
    from hivetune.model.lora import LoRASpec, apply_lora, lora_parameters

    model = random_model(qwen25_shape(4096, 256, 704, 2, 8, 2, True), "cuda", torch.bfloat16)
    torch.manual_seed(0)
    apply_lora(model, LoRASpec(r=8, alpha=16, dropout=0.0))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.02)
    batch = collate_packed(workload_examples(6, 4096, cap=0, seed=1), pad_id=0).to("cuda")
    return model, batch


def bf16_loss_and_grads(model, batch) -> tuple[float, torch.Tensor]:
    """GPU tests: (loss, every LoRA gradient flattened into one fp32 vector) of one bf16 autocast
    forward + backward of `batch`, the gradients cleared first."""
    from hivetune.model.lora import lora_parameters
    from hivetune.ops.loss import target_loss_sum

    for p in lora_parameters(model):
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = model(batch.input_ids, batch.position_ids, batch.layout)
        loss = target_loss_sum(hidden, model.lm_head.weight, batch.target_index, batch.target_ids,
                               softcap=model.args.final_logit_softcapping)
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in lora_parameters(model)])


# GPU tests that run first, under tight allocator caps (see pytest_collection_modifyitems)
FIRST = ("test_oom_auto.py", "test_auto_offload.py")


def pytest_collection_modifyitems(config, items):
    """tests/gpu/test_oom_auto.py and test_auto_offload.py run first. The first's calibration
    measures what a training step adds to the memory the caching allocator reserves, the second
    trains under a ~1.4 GiB cap, and earlier GPU tests leave memory behind that empty_cache cannot
    return (after test_graphs, the aborted capture's private pool: 1.35 GiB still allocated on an
    H100, where the calibration then read 0.70 and 0.90 GiB for 4 and 8 examples instead of 0.89
    and 1.78; test_auto_offload runs out of memory after test_cuda_blas)."""
    items.sort(key=lambda item: 0 if item.path.name in FIRST else 1)  # stable: the rest keep their order


def hub_cache_repo(cache: Path, repo: str, source: Path, repo_type: str = "model",
                   commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """`source`'s files as the Hub cache holds a repo: {models,datasets}--ORG--NAME/snapshots/
    <commit>/... and refs/main naming the commit (what huggingface_hub writes on download).
    Returns the snapshot folder."""
    import shutil

    root = cache / f"{repo_type}s--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache under a tmp HF_HOME, offline: nothing can reach the network."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    return cache


def kill_torchrun_train_after(args: list, run: Path, step: int, env: dict, timeout: float = 300) -> int:
    """Start `hivetune train --nproc-per-node 2 ... --output run`, SIGKILL the command (not torchrun,
    not its workers) once the step-`step` checkpoint exists, and wait until no process of the run is
    left (each dies with its parent). Returns the newest checkpoint's step."""
    import signal
    import subprocess
    import sys
    import time

    from hivetune.checkpoint import checkpoint_folders

    def steps():
        return [int(p.name[5:]) for p in checkpoint_folders(run / "checkpoints")]

    def live():  # processes whose command line names the run folder (zombies are dead)
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except (OSError, IndexError):
                continue
            if str(run) in cmdline.split("\0") and state not in "ZX":
                found.append(int(pid))
        return found

    proc = subprocess.Popen([sys.executable, "-m", "hivetune", "train", "--nproc-per-node", "2", *args,
                             "--output", str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + timeout
    while step not in steps():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"no step-{step} checkpoint in {timeout} s"
        time.sleep(0.02)
    workers = [pid for pid in live() if pid != proc.pid]
    assert len(workers) >= 3, workers  # torchrun and its two workers
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while live():
        assert time.monotonic() < deadline, f"still running 60 s after the kill: {live()}"
        time.sleep(0.05)
    assert not (run / "adapter").exists()  # killed before the end
    return max(steps())
