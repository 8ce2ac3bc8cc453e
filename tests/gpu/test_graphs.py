"""CUDA graphs (hivetune.train.replay) against eager on the GPU: same losses and LoRA gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hivetune.workflows.workloads import qwen25_shape, random_model, workload_examples
from hivetune.core.config import load_config
from hivetune.data.batch import collate_packed
from hivetune.data.dataset import TokenizedExamples
from hivetune.model.lora import lora_parameters
from hivetune.plan.graph_sizes import bucket_tokens
from hivetune.train import graph_plan, replay
from hivetune.train.graph_batch import batch_key, keeps_graphs, release_generator
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.train.loop import fit
from hivetune.train.setup import assemble
from hivetune.train.step import forward_backward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 4096


def small_run(tmp_path: Path, dropout: float = 0.0, **cfg):
    args = qwen25_shape(VOCAB, 256, 512, 3, 8, 2, True)  # head_dim 32, GQA 4
    model = random_model(args, "cuda", torch.bfloat16)
    examples = TokenizedExamples(workload_examples(64, VOCAB, cap=0, seed=5))
    values = {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda", "batch_size": 4,
              "max_steps": 10, "lr": 1e-3, "warmup_steps": 0, "eval_prompts": 0, "max_length": 4096,
              "lora": {"r": 8, "alpha": 16, "dropout": dropout}, **cfg}
    conf = load_config(None, values)
    run = assemble(conf, model, examples, None, torch.device("cuda"), "bf16", tmp_path / "run", Path("random"))
    with torch.no_grad():  # B = 0 at init: give the update values so every gradient is non-trivial
        for p in lora_parameters(model):
            p.normal_(0, 0.02)
    return run, examples


def grads_of(run):
    return torch.cat([p.grad.flatten().float() for p in lora_parameters(run.model)])


def test_graphed_micro_batches_match_eager(tmp_path):
    """Several micro-batches over four keys (64-token buckets), some keys met twice:
    loss and LoRA gradients equal eager's within bf16 tolerance."""
    run, examples = small_run(tmp_path)
    run.model.train()
    graphed = graph_plan.graphed(run, fused_target_loss_sum, eager=None, bucket=64)
    sizes = [(0, 3), (3, 6), (6, 8), (20, 22), (0, 3), (8, 11), (3, 6)]  # 686 341 377 355 686 475 341 tokens
    seen = set()
    for start, end in sizes:
        batch = collate_packed([examples.example(i) for i in range(start, end)], pad_id=0)
        n_targets = batch.target_ids.numel() + 5
        for p in lora_parameters(run.model):
            p.grad = None
        ref = forward_backward(run, batch.to("cuda"), n_targets, fused_target_loss_sum)
        ref_grads = grads_of(run)
        for p in lora_parameters(run.model):
            p.grad = None
        loss = graphed(batch, n_targets)
        got = grads_of(run)
        seen.add(batch_key(batch, 64))
        assert loss.item() == pytest.approx(ref.item(), rel=5e-3)
        assert torch.nn.functional.cosine_similarity(got, ref_grads, dim=0).item() > 0.999
        assert (got - ref_grads).norm() / ref_grads.norm() < 2e-2
    assert graphed.off is None
    # The first call captures the step plan's keys (batches of 4), the test's own keys (2 or 3
    # examples) are captured when met; every call is a replay (the first after a warm-up through
    # the model cut to two layers).
    planned = set(graph_plan.planned_keys(run, 64))
    assert len(seen) >= 4 and not seen & planned
    assert graphed.stats["graphs"] == len(planned | seen)
    assert graphed.stats["replays"] == len(sizes) and graphed.stats["warmup_layers"] == replay.PRELOAD_LAYERS


def test_graphed_replay_accumulates_and_draws_fresh_dropout(tmp_path):
    run, examples = small_run(tmp_path, dropout=0.3)
    run.model.train()
    graphed = graph_plan.graphed(run, fused_target_loss_sum, eager=None, bucket=128)
    batch = collate_packed([examples.example(i) for i in range(4)], pad_id=0)
    n = batch.target_ids.numel()
    losses = []
    for _ in range(3):  # a warm-up of the model cut to two layers, capture and replay, then two more
        for p in lora_parameters(run.model):
            p.grad = None
        losses.append(graphed(batch, n).item())
    assert graphed.stats["replays"] == 3
    assert len(set(losses)) == 3  # each replay draws new dropout masks
    one = grads_of(run).clone()
    graphed(batch, n)  # grads not reset: a second micro-batch accumulates into the same .grad
    assert grads_of(run).norm() > one.norm() * 1.5


def fit_losses(tmp_path, name, dropout: float = 0.0, **cfg):
    run, _ = small_run(tmp_path / name, dropout, **cfg)
    fit(run, progress=False)
    return [json.loads(line)["loss"] for line in (run.folder / "metrics.jsonl").read_text().splitlines()]


def test_fit_with_graphs_tracks_eager(tmp_path):
    """train.fit with cuda_graphs on and off (dropout 0, grad_accum 2): the same loss curve."""
    eager = fit_losses(tmp_path, "eager", cuda_graphs=False, grad_accum=2)
    graphed = fit_losses(tmp_path, "graphed", cuda_graphs=True, grad_accum=2)
    assert replay.last_stats["replays"] > 0 and replay.last_stats["off"] is None
    assert len(graphed) == 10 and all(x is not None for x in graphed)
    assert graphed == pytest.approx(eager, rel=1e-2)


def test_eager_steps_into_the_persistent_gradients_train_as_plain_eager_steps(tmp_path, monkeypatch):
    """Graphs off at the first call (compute-bound): the eager steps add into the persistent
    gradients (GradArena), clip and step over their one buffer; the loss curve is plain eager's
    (cuda_graphs off: fresh gradients each step), dropout on, two micro-batches a step."""
    from hivetune.plan import graph_sizes

    plain = fit_losses(tmp_path, "plain", dropout=0.1, cuda_graphs=False, grad_accum=2)
    monkeypatch.setattr(graph_sizes, "MAX_TFLOP_PER_MICRO_BATCH", 1e-6)
    arena = fit_losses(tmp_path, "arena", dropout=0.1, cuda_graphs=True, grad_accum=2)
    assert replay.last_stats["off"].startswith("compute-bound") and replay.last_stats["replays"] == 0
    assert len(arena) == 10 and arena == pytest.approx(plain, rel=1e-4)


def test_compute_bound_micro_batches_stay_eager(tmp_path, monkeypatch, capsys):
    run, examples = small_run(tmp_path)
    from hivetune.plan import graph_sizes

    monkeypatch.setattr(graph_sizes, "MAX_TFLOP_PER_MICRO_BATCH", 1e-6)
    batch = collate_packed([examples.example(i) for i in range(3)], pad_id=0)
    ran = []
    graphed = graph_plan.graphed(run, fused_target_loss_sum, eager=lambda b, n: ran.append(n) or n)
    assert graphed(batch, 7) == 7 and ran == [7]
    # eager calls add into the persistent gradients, as graphs do
    assert all(p.grad is g for p, g in zip(graphed.params, graphed.grads))
    assert graphed.off.startswith("compute-bound micro-batches, ~0 TFLOP each")
    assert graphed.stats["graphs"] == 0 and graphed.stats["eager"] == 1
    assert "hivetune: CUDA graphs off (compute-bound micro-batches" in capsys.readouterr().err


def graphs_micro_batches(run, step):
    from hivetune.train.step import micro_batches

    return micro_batches(run, step)


def _fake(tokens, segments):
    """A host micro-batch with `tokens` tokens and segments - 2 examples (for key_of)."""
    from hivetune.data.batch import MicroBatch
    from hivetune.ops.attention import Packed

    cu = torch.zeros(segments - 1, dtype=torch.int32)
    ids = torch.zeros(1, tokens, dtype=torch.long)
    return MicroBatch(ids, ids, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                      Packed(cu, tokens, ()), segments - 2, tokens)


def test_a_failed_background_instantiation_turns_graphs_off(tmp_path, monkeypatch):
    """An instantiation that raises on the worker thread is seen at the graph's first replay:
    graphs go off with one line, as after a failed capture, and the run goes on eagerly."""
    if not keeps_graphs():
        pytest.skip("this torch cannot capture without instantiating")

    def boom(self):
        raise RuntimeError("instantiation refused (test)")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "instantiate", boom)
    run, examples = small_run(tmp_path, batch_size=4)
    run.model.train()
    graphed = graph_plan.graphed(run, fused_target_loss_sum, eager=lambda b, n: forward_backward(
        run, b.to(run.device), n, fused_target_loss_sum))
    batches = [b for step in run.steps[:3] for b in graphs_micro_batches(run, step)]
    losses = [graphed(b, 1000) for b in batches]
    assert all(torch.isfinite(loss) for loss in losses)
    off = graphed.stats["off"]
    assert off.startswith("instantiating a ") and "instantiation refused (test)" in off
    assert graphed.stats["replays"] == 0 and graphed.stats["eager"] == len(batches) - 1


def test_a_resumed_run_captures_the_sizes_its_checkpoint_saved(tmp_path):
    """The second call plans the sizes (on its replay of the largest graph) and leaves them on the
    run (train.save_all_ranks puts them in checkpoints); a run whose counters hold saved sizes
    captures exactly those at its first call, with no plan, and every planned micro-batch finds
    one that holds it."""
    run, _ = small_run(tmp_path / "fresh", batch_size=4)
    run.model.train()
    graphed = graph_plan.graphed(run, fused_target_loss_sum, eager=None)
    for step in run.steps[:2]:
        graphed(next(iter(graphs_micro_batches(run, step))), 1000)
    assert run.graph_sizes == graphed.sizes and graphed.stats["capture_tokens"] > 0
    saved = {seg: [max(sizes)] for seg, sizes in run.graph_sizes.items()}  # not what timing would pick
    resumed, _ = small_run(tmp_path / "resumed", batch_size=4)
    resumed.model.train()
    resumed.counters = {"graph_sizes": [saved]}
    again = graph_plan.graphed(resumed, fused_target_loss_sum, eager=None)
    loss = again(next(iter(graphs_micro_batches(resumed, resumed.steps[0]))), 1000)
    assert torch.isfinite(loss) and again.stats["capture_tokens"] == "saved"
    assert again.sizes == saved == resumed.graph_sizes
    assert set(again.buckets) == {(size, seg) for seg, sizes in saved.items() for size in sizes}
    for tokens, segments in graph_plan.planned_micro_batches(resumed):
        assert again.key_of(_fake(tokens, segments)) == (saved[segments][0], segments)


def one_capture_after_every_replay(monkeypatch):
    """Deferred captures with neither the lead of queued replays nor the wait for instantiations."""
    monkeypatch.setattr(replay.GraphedForwardBackward, "_lead_enough", lambda self: True)
    monkeypatch.setattr(replay.GraphedForwardBackward, "_instantiated", lambda self: True)


def test_deferred_captures_take_one_size_after_each_replay(tmp_path, monkeypatch):
    """defers_captures, with neither the lead nor the wait for instantiations: the first call
    captures the largest size, and the next after its replay; each later call captures the next
    one (those most micro-batches take first) after its replay, and a micro-batch takes the
    smallest size captured so far that holds it. The losses and the accumulated gradients equal
    those of the graphs all captured at once (other padding: bf16 tolerance)."""
    one_capture_after_every_replay(monkeypatch)

    def run_graphs(name, defer):
        torch.manual_seed(0)
        run, _ = small_run(tmp_path / name, batch_size=4)
        run.model.train()
        planned = graph_plan.planned_micro_batches(run)
        sizes = {}
        for tokens, seg in planned:  # the three largest of the micro-batches' 64-token buckets
            sizes.setdefault(seg, set()).add(bucket_tokens(tokens, 64))
        run.counters = {"graph_sizes": [{seg: sorted(s)[-3:] for seg, s in sizes.items()}]}
        graphed = graph_plan.graphed(run, fused_target_loss_sum, eager=None, defer=defer)
        out, keys, counts = [], [], []
        for step in run.steps[:6]:
            for batch in graphs_micro_batches(run, step):
                keys.append(graphed.key_of(batch) if graphed.warmed else None)
                out.append(graphed(batch, 1000).item())
                counts.append(graphed.stats["graphs"])
        assert graphed.off is None
        return out, grads_of(run), keys, counts, graphed

    ref, ref_grads, ref_keys, ref_counts, upfront = run_graphs("upfront", False)
    got, got_grads, keys, counts, deferred = run_graphs("deferred", True)
    n = upfront.stats["graphs"]
    assert n == 3 and len(ref) == 6 and ref_counts == [n] * len(ref)
    assert counts == [min(i + 2, n) for i in range(len(got))]  # one more after each replay, the first's too
    assert deferred.stats["deferred"] == n - 1 and deferred.stats["replays"] == len(got)
    assert all(k[0] >= r[0] for k, r in zip(keys[1:], ref_keys[1:]))  # larger sizes while some wait
    assert keys[-1] == ref_keys[-1]
    later = list(deferred.buckets)[1:]
    assert sum(deferred.uses.values()) == len(deferred.plan_inputs().micro)
    assert [deferred.uses[k] for k in later] == sorted((deferred.uses[k] for k in later), reverse=True)
    assert got == pytest.approx(ref, rel=5e-3)
    assert (got_grads - ref_grads).norm() / ref_grads.norm() < 2e-2


def test_host_probe_measures_this_gpu():
    """bench's host probe: an 8192^3 bf16 matmul's rate within what the GPU can do (H100 / H200:
    989 TFLOP/s dense; above 100 unless the GPU is badly throttled), a launch's host cost in us."""
    from hivetune.workflows.bench import host_probe, peak_tflops

    probe = host_probe(torch.device("cuda", 0))
    peak = peak_tflops(torch.device("cuda", 0))
    assert 0 < probe["matmul_tflops"] <= (peak or 10_000)
    if peak and peak > 500:
        assert probe["matmul_tflops"] > 100
    assert 0.5 < probe["launch_us"] < 1000


def test_bench_allocator_counts_see_a_cudamalloc():
    """bench.allocator_counts: a fresh block beyond the cache is one more cudaMalloc."""
    from hivetune.workflows.bench import ALLOCATOR_COUNTS, allocator_counts

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    before = allocator_counts(device)
    block = torch.empty(2**29, dtype=torch.bfloat16, device=device)  # 1 GiB: a segment of its own
    after = allocator_counts(device)
    del block
    assert tuple(after) == ALLOCATOR_COUNTS and after["num_device_alloc"] == before["num_device_alloc"] + 1
    assert after["num_ooms"] == before["num_ooms"]


@pytest.mark.parametrize("wide", ["false", "true"])
def test_lora_weight_gradients_on_a_side_stream_match_the_one_stream_graphs(tmp_path, monkeypatch, wide):
    """By default, inside a capture each LoRA group's A and B gradients run on a second stream,
    joined after the backward (the reference: on the one stream). Over 6 steps of micro-batches
    (dropout 0.1: the seeded kernels; the wide layout and the plain one), without optimizer steps,
    the losses are bitwise those of the one-stream graphs and the accumulated gradients equal
    them to rounding (the side stream changes the allocation pattern, so a product may meet other
    pointer alignments and take another cuBLASLt algorithm, which adds the tokens in another order
    and can round a bf16 intermediate such as g B the other way: up to 5.4e-4 relative measured on
    an H200; a gradient missed or raced is off by its whole size); the side stream is used (every
    group, every capture)."""
    from hivetune.ops import lora_aside, lora_group
    def run_graphs(name):
        torch.manual_seed(0)
        run, _ = small_run(tmp_path / name, dropout=0.1, wide_lora=wide)
        run.model.train()
        before = sum(a.blocks for a in lora_aside._ASIDE.values())
        graphed = graph_plan.graphed(run, fused_target_loss_sum, eager=None, bucket=128)
        out = [graphed(batch, 1000).item() for step in run.steps[:6] for batch in graphs_micro_batches(run, step)]
        torch.cuda.synchronize()
        assert graphed.off is None and graphed.stats["replays"] == len(out)
        return out, grads_of(run), sum(a.blocks for a in lora_aside._ASIDE.values()) - before, graphed.stats

    with monkeypatch.context() as one_stream:
        one_stream.setattr(lora_group, "aside_wanted", lambda g: False)
        ref, ref_grads, ref_blocks, _ = run_graphs("one-stream")
    got, got_grads, blocks, stats = run_graphs("side-stream")
    assert ref_blocks == 0 and blocks == 3 * 4 * stats["graphs"]  # 3 layers x 4 groups a capture
    assert got == ref
    assert ref_grads.norm() > 0 and (got_grads - ref_grads).norm() / ref_grads.norm() < 2e-3


def test_a_failed_capture_leaves_the_generator_usable():
    """A capture that fails midway leaves torch's CUDA generator in its capture state (capture_end
    raises before its epilogue), where every later draw fails; release_generator (called on each
    failed capture in train.replay) gives it back, seed and offset kept."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    seed = generator.initial_seed()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        with pytest.raises(Exception):
            torch.cuda.synchronize()  # not allowed while capturing: the capture is invalidated
        with pytest.raises(Exception):
            graph.capture_end()
    with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
        torch.rand(4, device="cuda")
    offset = generator.get_offset()
    release_generator(torch.device("cuda"))
    assert generator.initial_seed() == seed and generator.get_offset() == offset
    assert torch.rand(4, device="cuda").shape == (4,)
    assert generator.get_offset() > offset


def test_graphs_take_each_micro_batchs_dropout_seeds(tmp_path):
    """fit's micro-batches carry their dropout seeds (train.dropout_seeds), which a graph reads
    from its static inputs: replays of one micro-batch with its seeds give the same loss, bit for
    bit (not fresh masks from torch's generator); the next step's seeds give other masks; and
    each replay is closer to eager's loss with its own seeds than with the other ones."""
    from hivetune.train.step import micro_batches

    run, _ = small_run(tmp_path, dropout=0.3)
    run.model.train()
    with torch.no_grad():  # LoRA large enough that the masks move the loss well beyond bf16 noise
        for p in lora_parameters(run.model):
            p.normal_(0, 0.2)
    first = next(iter(micro_batches(run, run.steps[0], step=0)))
    second = next(iter(micro_batches(run, run.steps[0], step=1)))  # the same examples, other seeds
    assert first.dropout_seeds.numel() == len(run.model.lora_casts.slots)
    assert not torch.equal(first.dropout_seeds, second.dropout_seeds)
    n = first.target_ids.numel()
    eager = [forward_backward(run, b.to("cuda"), n, fused_target_loss_sum).item() for b in (first, second)]
    graphed = graph_plan.graphed(run, fused_target_loss_sum, eager=None, bucket=128)
    losses = []
    for generator_seed in (1, 2, 3):  # three replays; the generator plays no part
        torch.manual_seed(generator_seed)
        losses.append(graphed(first, n).item())
    moved = graphed(second, n).item()
    assert graphed.stats["replays"] == 4 and graphed.n_seeds == first.dropout_seeds.numel()
    assert losses[0] == losses[1] == losses[2] and moved != losses[1]
    assert losses[1] == pytest.approx(eager[0], rel=5e-3) and moved == pytest.approx(eager[1], rel=5e-3)
    assert abs(losses[1] - eager[0]) < abs(losses[1] - eager[1])
    assert abs(moved - eager[1]) < abs(moved - eager[0])


def deferred_run(folder: Path):
    """20 micro-batches (2 epochs of 10 steps) through deferred captures, each loss read at once
    (the host never leads): (losses, LoRA gradients, the GraphedForwardBackward)."""
    torch.manual_seed(0)
    run, _ = small_run(folder, max_steps=20, epochs=2)
    run.model.train()
    graphed = graph_plan.graphed(run, fused_target_loss_sum, eager=None, defer=True)
    batches = [batch for step in run.steps for batch in graphs_micro_batches(run, step)]
    assert len(batches) == 20
    losses = [graphed(batch, 1000).item() for batch in batches]
    torch.cuda.synchronize()
    return losses, grads_of(run), graphed


def test_deferred_captures_wait_for_a_lead_of_queued_replays(tmp_path, monkeypatch):
    """Deferred captures (planned sizes, a capture costed at 1 token: every 64-token size the
    plan meets, all but the largest deferred) with a lead of 2 and every loss read at once (the
    host never leads): each capture comes at the cap, 8 replays after the previous one, so 20
    micro-batches (19 replays) make 2 deferred captures where one capture after every replay
    makes one each time; the losses agree within the padding's rounding, the gradients too.
    (A fixed grid would not do: there a micro-batch whose size is still pending is captured
    when met, outside the replays the lead counts.)"""
    monkeypatch.setattr(replay, "CAPTURE_LEAD", 2)
    monkeypatch.setattr(replay, "capture_cost_tokens", lambda capture_s, s_per_token: 1.0)
    with monkeypatch.context() as lead_alone:  # no wait for instantiations: the lead alone
        lead_alone.setattr(replay.GraphedForwardBackward, "_instantiated", lambda self: True)
        losses, grads, graphed = deferred_run(tmp_path / "lead")
    stats, left = graphed.stats, len(graphed.pending)
    assert left >= 1 and stats["deferred"] == 2 and stats["lead_waits"] == ["cap", "cap"]
    one_capture_after_every_replay(monkeypatch)
    ref_losses, ref_grads, ref = deferred_run(tmp_path / "reference")
    ref_stats = ref.stats
    assert "lead_waits" not in ref_stats and ref_stats["deferred"] == min(2 + left, 19) and not ref.pending
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    assert (grads - ref_grads).norm() / ref_grads.norm() < 2e-2


def test_preloaded_deferred_captures_match_the_reference(tmp_path, monkeypatch):
    """The preload: once the plan is made, each deferred size is captured through the model cut
    to its first layer (dropped unrun) and its bucket kept for the real capture; the model keeps
    its layers, and the losses and gradients match the run without the preload (a capture after
    every replay either way) within the padding's rounding."""
    one_capture_after_every_replay(monkeypatch)
    monkeypatch.setattr(replay, "capture_cost_tokens", lambda capture_s, s_per_token: 1.0)
    losses, grads, graphed = deferred_run(tmp_path / "preload")
    stats = graphed.stats
    model = graphed.model
    assert len(model.model.layers) == model.args.num_hidden_layers > 1 and stats["eager"] == 0 and not stats["off"]
    assert stats["preloaded"] >= 2 and stats["preloaded"] == stats["deferred"] + len(graphed.pending)
    assert set(graphed.preloaded) >= set(graphed.pending)
    monkeypatch.setattr(replay.GraphedForwardBackward, "_preload", lambda self, keys: None)
    ref_losses, ref_grads, ref = deferred_run(tmp_path / "reference")
    assert "preloaded" not in ref.stats and ref.stats["deferred"] == stats["deferred"]
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    assert (grads - ref_grads).norm() / ref_grads.norm() < 2e-2


def test_deferred_captures_wait_for_the_instantiations(tmp_path, monkeypatch):
    """The wait for instantiations: no deferred capture begins while a background
    instantiation is in flight (stats began_instantiating stays unset); losses and gradients
    match the run without that wait, within the padding's rounding."""
    monkeypatch.setattr(replay, "capture_cost_tokens", lambda capture_s, s_per_token: 1.0)
    losses, grads, graphed = deferred_run(tmp_path / "after")
    stats = graphed.stats
    assert stats["deferred"] >= 1 and "began_instantiating" not in stats
    monkeypatch.setattr(replay.GraphedForwardBackward, "_instantiated", lambda self: True)
    ref_losses, ref_grads, ref = deferred_run(tmp_path / "reference")
    assert "held_for_instantiation" not in ref.stats
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    assert (grads - ref_grads).norm() / ref_grads.norm() < 2e-2


def test_default_graph_plan_holds_targets_and_replays_everything(tmp_path, monkeypatch):
    """The defaults (sizes planned on the first replay, deferred captures with the preload, the
    lead of CAPTURE_LEAD, the wait for instantiations, target capacities): no micro-batch runs
    eagerly, and the planned sizes hold as many targets as their micro-batches bring (the
    largest: the most of any), fewer than one a token."""
    monkeypatch.setattr(replay, "capture_cost_tokens", lambda capture_s, s_per_token: 1.0)
    losses, grads, graphed = deferred_run(tmp_path / "defaults")
    stats = graphed.stats
    assert stats["eager"] == 0 and not stats["off"] and stats["plan"] == "on the first replay"
    assert graphed.plan_due is None and stats["target_capacity"] and graphed.lead == replay.CAPTURE_LEAD == 3
    narrow = [b for (t, _), b in graphed.buckets.items() if b.targets < t]
    assert len(narrow) >= 1 and all(b.batch.target_ids.numel() == b.targets for b in narrow)
    assert all(torch.isfinite(torch.tensor(losses))) and torch.isfinite(grads).all()


def test_size_plan_times_one_replay_of_the_largest_graph(tmp_path, monkeypatch):
    """The plan's GPU seconds a token come from one replay: its timing events are each recorded
    once, around the replay of the largest graph that the first micro-batch takes, and not again
    around the second call's replay of that graph (which would time two replays and the host's
    work between them, and make _finish_plan wait for the second)."""
    records = []  # (event, replays counted when recorded) of the timing events recorded in _replay
    inside = {}

    class Spied(torch.cuda.Event):
        def __init__(self, enable_timing=False, **kwargs):
            self.timing = enable_timing

        def record(self, stream=None):
            if self.timing and inside:
                records.append((self, inside["graphed"].stats["replays"]))
            return super().record(stream)

    replay_of = replay.GraphedForwardBackward._replay

    def spied_replay(self, key, bucket):
        inside["graphed"] = self
        try:
            return replay_of(self, key, bucket)
        finally:
            inside.clear()

    monkeypatch.setattr(torch.cuda, "Event", Spied)
    monkeypatch.setattr(replay.GraphedForwardBackward, "_replay", spied_replay)
    _, _, graphed = deferred_run(tmp_path / "timed")
    assert graphed.stats["plan"] == "on the first replay" and graphed.stats["plan_us_per_token"] > 0
    assert len(records) == 2 and records[0][0] is not records[1][0]
    assert (records[0][1], records[1][1]) == (0, 1)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_checkpointed_layers_recompute_with_their_forwards_dropout_seeds(graphed, tmp_path):
    """Seeded LoRA dropout (p 0.3) with gradient checkpointing, eager and CUDA-graphed: the
    recompute in backward takes the forward's seeds (lora_casts.SeedTape), so the loss and LoRA
    gradients equal the plain eager forward's with the same seeds. Drawing fresh seeds there
    gave other masks: ~0.6 relative error."""
    from hivetune.train.step import dropout_seeds

    run, examples = small_run(tmp_path, dropout=0.3)
    run.model.train()
    fn = graph_plan.graphed(run, fused_target_loss_sum, eager=None, bucket=64) if graphed else None
    for k, (start, end) in enumerate([(0, 3), (3, 6), (0, 3)]):
        batch = collate_packed([examples.example(i) for i in range(start, end)], pad_id=0)
        batch.dropout_seeds = dropout_seeds(run, 0, k)
        n = batch.target_ids.numel()
        results = []
        for checkpointing in (False, True):
            run.model.gradient_checkpointing = checkpointing
            for p in lora_parameters(run.model):
                p.grad = None
            if fn is not None and checkpointing:
                loss = fn(batch, n)
            else:
                loss = forward_backward(run, batch.to("cuda"), n, fused_target_loss_sum)
            results.append((loss.item(), grads_of(run).clone()))
        (plain_loss, plain), (ckpt_loss, ckpt) = results
        assert ckpt_loss == pytest.approx(plain_loss, rel=1e-3)
        # eager: the same kernels, recomputed; graphed: bf16 noise between graphed and eager (2.5e-3)
        assert (ckpt - plain).norm() / plain.norm() < 1e-2, (k, ((ckpt - plain).norm() / plain.norm()).item())
    if fn is not None:
        assert fn.stats["replays"] >= 2 and fn.off is None
    run.model.gradient_checkpointing = False
