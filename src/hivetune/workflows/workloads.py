"""The benchmark workloads W1, W2, W4 and the preference workload PW1 (benchmarks/README.md):
random-init Qwen2.5 / Qwen3 shapes and generator data, so that they need no model hub and time the same work on any machine.

Throughput does not depend on the values of the weights; the model gets HF's initialisation
so that its losses start near ln(vocab), as a real run's do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from hivetune.data.dataset import TokenizedExamples
from hivetune.data.formats import Encoded
from hivetune.data.pairs import EncodedPair, PairIndex
from hivetune.model.config import ModelArgs, qwen3_shape, qwen25_shape
from hivetune.model.decoder import CausalLM
from hivetune.model.quant import quantize_model


@dataclass(frozen=True)
class Lengths:
    """The generator's length mix: p = randint(*prompt) prompt tokens, then
    r = int(min(response_max, max(response_min, lognormvariate(mu, sigma)))) response tokens."""

    prompt: tuple[int, int] = (16, 96)
    mu: float = 4.8
    sigma: float = 0.6
    response_min: int = 8
    response_max: int = 400


SHORT = Lengths()  # W1, W2
LONG_TAIL = Lengths((32, 1024), 6.0, 0.8, 16, 3072)  # W4


@dataclass
class Workload:
    name: str
    args: ModelArgs
    n_examples: int
    cap: int  # tokens an example keeps; 0: no cap
    epochs: float
    examples_per_step: int
    lora: dict
    # examples per forward / backward (0: all of the step's), the rest by accumulation; the
    # optimizer still sees examples_per_step per step.
    micro_batch: int = 0
    lengths: Lengths = SHORT
    # HF baseline: micro-batches tried largest first, the next on out-of-memory (grad_accum makes
    # up examples_per_step); empty: the seeds' config, batch 2
    hf_batches: tuple[int, ...] = ()
    method: str = "sft"  # dpo: n_examples preference pairs (workload_pairs), examples_per_step pairs a step

    def examples(self) -> list[Encoded] | list[EncodedPair]:
        if self.method != "sft":
            return workload_pairs(self.n_examples, self.args.vocab_size, lengths=self.lengths)
        return workload_examples(self.n_examples, self.args.vocab_size, self.cap, lengths=self.lengths)

    def data(self) -> TokenizedExamples | PairIndex:
        """The examples as the loop's data (train.setup.assemble takes either)."""
        if self.method != "sft":
            return PairIndex(Path("generator"), self.examples())
        return TokenizedExamples(self.examples())


WORKLOADS = {
    # Qwen2.5-0.5B shape, LoRA r 8 on the 7 linear modules, 3 epochs of 1,500 examples, 8 a step
    "W1": Workload("W1", qwen25_shape(151936, 896, 4864, 24, 14, 2, True), 1500, 0, 3.0, 8,
                   {"r": 8, "alpha": 16, "dropout": 0.05}),
    # Qwen2.5-7B shape, LoRA r 32, 1 epoch of 1,500 examples capped at 256 tokens, 16 a step
    "W2": Workload("W2", qwen25_shape(152064, 3584, 18944, 28, 28, 4, False), 1500, 256, 1.0, 16,
                   {"r": 32, "alpha": 64, "dropout": 0.05}),
    # Qwen3-1.7B shape (head_dim 128, q/k norm), LoRA r 16, 1 epoch of 800 long-tail examples
    # capped at 4096 tokens (831,370 tokens, mean 1,039, max 4,023), 8 a step
    "W4": Workload("W4", qwen3_shape(151936, 2048, 6144, 28, 16, 8, 128, True), 800, 4096, 1.0, 8,
                   {"r": 16, "alpha": 32, "dropout": 0.05}, lengths=LONG_TAIL, hf_batches=(8, 4, 2)),
    # W2's data and LoRA (32B: r 16) on the Qwen2.5-14B and -32B shapes, 4 examples a step: the quantized
    # base's cards (bench W2-14B --set base_quant=nf4 --memory-cap 16)
    "W2-14B": Workload("W2-14B", qwen25_shape(152064, 5120, 13824, 48, 40, 8, False), 200, 256, 1.0, 4,
                       {"r": 32, "alpha": 64, "dropout": 0.05}),
    "W2-32B": Workload("W2-32B", qwen25_shape(152064, 5120, 27648, 64, 40, 8, False), 200, 256, 1.0, 4,
                       {"r": 16, "alpha": 32, "dropout": 0.05}),  # r 32's 268M LoRA weights + Adam: 4.3 GB
    # W1's model and LoRA, DPO: 1 epoch of 1,500 generator pairs (a W1 prompt, two W1 responses), 8 a step
    "PW1": Workload("PW1", qwen25_shape(151936, 896, 4864, 24, 14, 2, True), 1500, 0, 1.0, 8,
                    {"r": 8, "alpha": 16, "dropout": 0.05}, method="dpo"),
}


def workload_examples(n: int, vocab: int, cap: int = 0, seed: int = 0, lengths: Lengths = SHORT) -> list[Encoded]:
    """The workloads' generator, call for call: p prompt tokens (masked), then r response tokens.
    W1: 298,259 tokens (213,895 of them response tokens), mean 198.8, max 496."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*lengths.prompt)
        r = int(min(lengths.response_max, max(lengths.response_min, rng.lognormvariate(lengths.mu, lengths.sigma))))
        ids = [rng.randrange(1000, vocab - 1000) for _ in range(p + r)]
        mask = [False] * p + [True] * r
        if cap:
            ids, mask = ids[:cap], mask[:cap]
        out.append(Encoded(ids, mask, truncated=False))
    return out


def workload_pairs(n: int, vocab: int, seed: int = 0, lengths: Lengths = SHORT) -> list[EncodedPair]:
    """PW1's generator: per pair, p prompt tokens as W1's, then the chosen and the rejected answer's
    lengths drawn independently as W1's response, then the tokens (prompt, chosen, rejected)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*lengths.prompt)
        c, r = (int(min(lengths.response_max, max(lengths.response_min, rng.lognormvariate(lengths.mu, lengths.sigma))))
                for _ in range(2))
        ids = [rng.randrange(1000, vocab - 1000) for _ in range(p + c + r)]
        out.append(EncodedPair(ids[:p], ids[p:p + c], ids[p + c:]))
    return out


def random_model(args: ModelArgs, device, dtype, base_quant: str = "none") -> CausalLM:
    """HF's initialisation (normal, std 0.02; norms at 1) so losses start near ln(vocab).
    base_quant nf4 / int8: built in `dtype` (a 32B shape in fp32 would not fit on one card),
    then its decoder linears quantized."""
    torch.manual_seed(0)
    if base_quant == "none":
        with torch.device(device):
            model = CausalLM(args)
        init_like_hf(model)
        return model.to(dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(args)
    finally:
        torch.set_default_dtype(default)
    init_like_hf(model)
    quantize_model(model, base_quant)
    return model


@torch.no_grad()
def init_like_hf(model: CausalLM) -> None:
    """In place, in parameter order: norms 1, biases 0, the rest normal(0, 0.02); all frozen."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02)
        p.requires_grad_(False)
