"""CUDA graphs for the preference step (dpo / orpo): one graph, sized for the run's largest
micro-batch, replayed for every micro-batch.

The preference step is host-bound: a micro-batch runs the model twice (the reference with LoRA
off, then the policy) and backward, ~10,000 kernels for ~30 ms of GPU work on PW1. A graph
replays them with one launch.

Padding. A micro-batch of P pairs holding S prompt tokens and N answer tokens (its row holds
T = S + N) becomes one of the run's P*, S*, N* (pair_sizes): pad pairs of pad_id tokens fill the
difference, each a pair of its own (attention never crosses pairs), weighted 0 in the loss and
the reward sums. Its row is collated again with the pads (data.pairs.collate_pairs), so the
mask's parts, the flash path's segments, the targets and the sequences all come from one place;
the flash path's max_q / max_k become the row's length (they size the launch grid only), the
same for every replay.

Only a process of its own (no torchrun), the shared-prompt row on the flash path, bf16 or fp16
without loss scaling; elsewhere the eager PreferenceStep runs, with one line saying why.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from hivetune.data.pairs import EncodedPair, PairBatch, collate_pairs
from hivetune.model.lora import lora_parameters
from hivetune.ops.shared_prompt import pairs_usable
from hivetune.train import step as step_mod
from hivetune.train.graph_batch import first_line, release_generator, step_refusal
from hivetune.train.replay import attach_persistent_grads, persistent_grads

ROW_GRAIN = 64  # S* and N* rounded up to a multiple of this
last_stats: dict = {}  # the most recent GraphedPairStep's stats (benchmarks and tests read them)


@dataclass(frozen=True)
class PairSizes:
    """The static sizes of a graphed micro-batch: pairs, prompt tokens, answer tokens."""

    pairs: int
    prompt: int
    answer: int

    @property
    def tokens(self) -> int:
        return self.prompt + self.answer


def _round_up(n: int, grain: int = ROW_GRAIN) -> int:
    return -(-n // grain) * grain


def pair_sizes(micro_batches: list[list[EncodedPair]]) -> PairSizes:
    """Sizes that hold every micro-batch with room for at least one pad pair (each pad pair takes
    one prompt token and one token of each answer at least)."""
    pairs = max(len(m) for m in micro_batches) + 1
    prompt = max(sum(len(e.prompt) for e in m) for m in micro_batches) + pairs
    answer = max(sum(len(e.chosen) + len(e.rejected) for e in m) for m in micro_batches) + 2 * pairs
    return PairSizes(pairs, _round_up(prompt), _round_up(answer))


def batch_pairs(batch: PairBatch) -> list[EncodedPair]:
    """The pairs of a shared-prompt micro-batch, read back from its row and parts."""
    pair, part = batch.parts
    counts = torch.bincount(pair * 3 + part, minlength=3 * batch.n_examples).view(-1, 3).tolist()
    ids, out, at = batch.input_ids[0].tolist(), [], 0
    for p, c, r in counts:
        out.append(EncodedPair(ids[at:at + p], ids[at + p:at + p + c], ids[at + p + c:at + p + c + r]))
        at += p + c + r
    return out


def pad_lengths(pairs: list[EncodedPair], sizes: PairSizes) -> list[tuple[int, int, int]]:
    """(prompt, chosen, rejected) lengths of the pad pairs that bring `pairs` to `sizes`: one
    token each, the rest of the prompt tokens in the first pad's prompt, of the answer tokens in
    its chosen answer."""
    n = sizes.pairs - len(pairs)
    prompt = sizes.prompt - sum(len(e.prompt) for e in pairs)
    answer = sizes.answer - sum(len(e.chosen) + len(e.rejected) for e in pairs)
    if n < 1 or prompt < n or answer < 2 * n:
        raise ValueError(f"a micro-batch of {len(pairs)} pairs ({prompt} prompt and {answer} answer tokens to spare) "
                         f"does not fit the graph's {sizes}")
    return [(prompt - n + 1, answer - 2 * n + 1, 1)] + [(1, 1, 1)] * (n - 1)


def pad_pair_batch(batch: PairBatch, sizes: PairSizes, pad_id: int = 0) -> tuple[PairBatch, torch.Tensor]:
    """(the micro-batch padded to `sizes`, the pairs' loss weights [P*]: 1 real, 0 pad); host tensors."""
    pairs = batch_pairs(batch)
    pads = [EncodedPair([pad_id] * p, [pad_id] * c, [pad_id] * r) for p, c, r in pad_lengths(pairs, sizes)]
    padded = collate_pairs(pairs + pads, pad_id, shared=True)
    padded.dropout_seeds = batch.dropout_seeds
    padded.segments.max_q = padded.segments.max_k = sizes.tokens
    weights = torch.zeros(sizes.pairs)
    weights[:len(pairs)] = 1.0
    return padded, weights


def _tensors(batch: PairBatch) -> list[torch.Tensor]:
    """Every tensor a graphed micro-batch reads, in one order."""
    s = batch.segments
    out = [batch.input_ids, batch.position_ids, batch.target_index, batch.target_ids, batch.target_seq,
           batch.seq_tokens, *batch.parts, s.cu_q, s.cu_k, s.key_index, s.first, s.second]
    return out + ([batch.dropout_seeds] if batch.dropout_seeds is not None else [])


def graphs_unsupported(run) -> str | None:
    """Why this run's preference step is not graphed, or None."""
    if run.parallel.enabled:
        return "torchrun"
    refusal = step_refusal(run)
    if refusal:
        return refusal
    if not run.cfg.preference.shared_prompt:
        return "preference.shared_prompt is off"
    dtype = torch.bfloat16 if run.precision == "bf16" else torch.float16
    if not pairs_usable(run.device, dtype):
        return "the flash path of preference rows is unavailable"
    return None


class GraphedPairStep:
    """fit's per-micro-batch call for dpo / orpo on CUDA, ``(batch on the host, the step's pair
    count) -> detached loss``, with PreferenceStep's step_stats; the eager `step` serves where
    the graph cannot (a micro-batch larger than `sizes`, a capture that failed)."""

    def __init__(self, run, eager, sizes: PairSizes):
        self.run, self.eager, self.sizes = run, eager, sizes
        self.params = lora_parameters(run.model)
        self.arena, self.grads = persistent_grads(self.params, run.model)
        self.stream = torch.cuda.Stream(device=run.device)
        self.graph = self.static = self.weights = self.n_pairs = self.loss = None
        self.off: str | None = None
        self.stats = {"graphs": 0, "replays": 0, "eager": 0, "capture_s": 0.0, "warmup_s": None,
                      "pad_tokens": 0, "tokens": 0, "sizes": [sizes.pairs, sizes.prompt, sizes.answer], "off": None}
        global last_stats
        last_stats = self.stats

    def step_stats(self, n_pairs: int) -> dict:
        return self.eager.step_stats(n_pairs)

    def __call__(self, batch: PairBatch, n_pairs: int) -> torch.Tensor:
        if not self.off and batch.n_examples < self.sizes.pairs:
            try:
                padded, weights = pad_pair_batch(batch, self.sizes, self.run.pad_id)
            except ValueError:  # larger than the run's plan: not expected, served eagerly
                padded = None
            if padded is not None:
                attach_persistent_grads(self.params, self.grads, self.arena)
                self.stats["tokens"] += batch.n_tokens
                self.stats["pad_tokens"] += self.sizes.tokens - batch.n_tokens
                if self.graph is None:
                    return self._warm_and_capture(padded, weights, n_pairs)
                self._load(padded, weights, n_pairs)
                self.graph.replay()
                self.stats["replays"] += 1
                return self.loss.clone()
        self.stats["eager"] += 1
        return self.eager(batch, n_pairs)

    def _load(self, padded: PairBatch, weights: torch.Tensor, n_pairs: int) -> None:
        for static, host in zip(self.static_tensors, _tensors(padded)):
            static.copy_(host.pin_memory(), non_blocking=True)
        self.weights.copy_(weights.pin_memory(), non_blocking=True)
        self.n_pairs.fill_(float(n_pairs))

    def _body(self) -> torch.Tensor:
        self.static._layout = None  # the mask is made from the static parts inside the graph
        return self.eager.body(self.static, self.n_pairs, self.weights)

    def _warm_and_capture(self, padded: PairBatch, weights: torch.Tensor, n_pairs: int) -> torch.Tensor:
        """The first micro-batch: its real work eagerly on the capture stream (lazy inits), then the capture."""
        device = self.run.device
        t0 = time.perf_counter()
        self.static = padded.to(device)
        self.static_tensors = _tensors(self.static)
        self.weights = weights.to(device)
        self.n_pairs = torch.full((), float(n_pairs), device=device)
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            loss = self._body().detach()
        main.wait_stream(self.stream)
        loss.record_stream(main)
        self.stats["warmup_s"] = round(time.perf_counter() - t0, 3)
        torch.cuda.empty_cache()  # the warm-up's blocks back, for the graph's pool to take
        t1 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(main)
        try:
            with torch.cuda.stream(self.stream):
                graph.capture_begin()
                try:
                    self.loss = self._body().detach()
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - any capture failure: eager from here
            torch.cuda.synchronize()
            release_generator(device)
            self.off = self.stats["off"] = f"capture failed: {first_line(e)}"
            print(f"hivetune: CUDA graphs off for the preference step ({self.off}); eager steps", file=sys.stderr)
            return loss
        main.wait_stream(self.stream)
        self.graph = graph
        self.stats["graphs"] = 1
        self.stats["capture_s"] = round(time.perf_counter() - t1, 3)
        return loss


def run_micro_batches(run) -> list[list[EncodedPair]]:
    """Every micro-batch of the run's step plan, as its pairs (step.micro_parts)."""
    return [[run.data.example(i) for i in part] for ids in run.steps for part in step_mod.micro_parts(run, ids)]


def preference_step_fn(run, eager):
    """The run's per-micro-batch call for dpo / orpo: GraphedPairStep where run.cfg.cuda_graphs
    and the run allow it, else `eager` (PreferenceStep)."""
    if not getattr(run.cfg, "cuda_graphs", False) or run.device.type != "cuda":
        return eager
    reason = graphs_unsupported(run)
    if reason:
        print(f"hivetune: CUDA graphs off for the preference step ({reason}); eager steps", file=sys.stderr)
        return eager
    return GraphedPairStep(run, eager, pair_sizes(run_micro_batches(run)))
