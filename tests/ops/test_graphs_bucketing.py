"""CUDA-graph bucketing on the CPU: padding a packed micro-batch to its bucket must not change
the loss or the LoRA gradients (fp32), and the eager fallback is forward_backward itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hivetune.workflows.workloads import qwen25_shape, random_model, workload_examples
from hivetune.core.config import load_config
from hivetune.data.batch import collate_packed
from hivetune.data.dataset import TokenizedExamples
from hivetune.model.lora import lora_parameters
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.plan.graph_sizes import bucket_tokens, capture_cost_tokens, deferrable, defers_captures
from hivetune.train.graph_batch import IGNORE_INDEX, batch_key, ignoring_loss_fn, pad_packed_batch
from hivetune.train.graph_plan import graphs_unsupported, micro_step_fn, planned_keys
from hivetune.ops.loss import target_loss_sum
from hivetune.train.setup import assemble
from hivetune.train.step import forward_backward, micro_batches


def tiny_run(tmp_path, dropout: float = 0.0, cap: int = 40, **cfg):
    """A real Run (train.assemble) of a 2-layer hidden-64 random Qwen2-shaped model on the CPU, fp32."""
    args = qwen25_shape(vocab=2100, hidden=64, intermediate=128, layers=2, heads=4, kv=2, tied=True)
    model = random_model(args, "cpu", torch.float32)
    values = {"model": "random", "data": "generator", "device": "cpu", "precision": "fp32", "eval_prompts": 0,
              "lora": {"r": 4, "alpha": 8, "dropout": dropout}, **cfg}
    examples = TokenizedExamples(workload_examples(16, 2100, cap=cap, seed=3))
    run = assemble(load_config(None, values), model, examples, None, torch.device("cpu"), "fp32",
                   tmp_path / "run", Path("random"))
    with torch.no_grad():  # B = 0 at init would leave A's gradient zero: give B values
        for p in lora_parameters(model):
            p.normal_(0, 0.05)
    model.train()
    return run


def packed_batch(n: int = 5, seed: int = 3):
    return collate_packed(workload_examples(n, 2100, cap=40, seed=seed), pad_id=0)


def loss_and_grads(run, batch, n_targets, loss_fn):
    for p in lora_parameters(run.model):
        p.grad = None
    loss = forward_backward(run, batch, n_targets, loss_fn)
    return loss, [p.grad.clone() for p in lora_parameters(run.model)]


def test_bucket_tokens_leave_room_for_a_pad_segment():
    assert bucket_tokens(1, 256) == 256
    assert bucket_tokens(255, 256) == 256
    assert bucket_tokens(256, 256) == 512  # a full bucket still needs one pad token
    assert bucket_tokens(1591, 256) == 1792


def test_pad_packed_batch_layout():
    batch = packed_batch()
    t, n = batch.input_ids.shape[1], batch.target_ids.numel()
    padded = pad_packed_batch(batch, 256, pad_id=7)
    assert padded.input_ids.shape == (1, 256) and padded.position_ids.shape == (1, 256)
    assert padded.input_ids[0, t:].eq(7).all() and padded.input_ids[0, :t].equal(batch.input_ids[0])
    assert padded.position_ids[0, t:].tolist() == list(range(256 - t))  # the pad segment restarts at 0
    assert padded.layout.cu_seqlens.tolist() == batch.layout.cu_seqlens.tolist() + [256]
    assert padded.layout.lengths == batch.layout.lengths + (256 - t,)
    assert padded.target_ids.numel() == padded.target_index.numel() == 256
    assert padded.target_ids[n:].eq(IGNORE_INDEX).all() and padded.target_index[n:].eq(255).all()
    assert padded.n_tokens == batch.n_tokens
    with pytest.raises(ValueError, match="cannot hold"):
        pad_packed_batch(batch, t, pad_id=0)


@pytest.mark.parametrize("loss_name", ["fused", "reference"])
def test_bucket_padding_keeps_loss_and_grads_fp32(loss_name, tmp_path):
    """What a graph replays (the padded batch, ignored pad targets, a tensor target count) gives
    the unpadded batch's loss and LoRA gradients."""
    run = tiny_run(tmp_path)
    batch = packed_batch()
    n_targets = batch.target_ids.numel() + 11  # the step's count: other micro-batches share it
    plain_fn = fused_target_loss_sum if loss_name == "fused" else target_loss_sum
    ignoring = ignoring_loss_fn(plain_fn)
    ref_loss, ref_grads = loss_and_grads(run, batch, n_targets, plain_fn)
    for tokens in (bucket_tokens(batch.input_ids.shape[1], 64), 256):
        padded = pad_packed_batch(batch, tokens)
        loss, grads = loss_and_grads(run, padded, torch.tensor(float(n_targets)), ignoring)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6, abs=1e-7)
        for g, r in zip(grads, ref_grads):
            assert torch.allclose(g, r, rtol=1e-6, atol=1e-7), (g - r).abs().max()
    assert sum(g.abs().sum() for g in ref_grads) > 0


def test_fused_loss_ignores_marked_targets():
    torch.manual_seed(0)
    hidden = torch.randn(1, 30, 16)
    weight = torch.randn(101, 16) / 4
    index = torch.arange(0, 30, 2)
    ids = torch.randint(0, 101, (15,))
    ids[[3, 9, 14]] = IGNORE_INDEX
    keep = ids != IGNORE_INDEX
    h1 = hidden.clone().requires_grad_(True)
    fused = fused_target_loss_sum(h1, weight, index, ids, chunk_bytes=4 * 101 * 4, ignore_index=IGNORE_INDEX)
    fused.backward()
    h2 = hidden.clone().requires_grad_(True)
    ref = target_loss_sum(h2, weight, index[keep], ids[keep])
    ref.backward()
    assert fused.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(h1.grad, h2.grad, atol=1e-7)
    assert h1.grad[0, 2 * 3].abs().sum() == 0  # an ignored target's row gets no gradient


def test_cpu_run_takes_the_eager_path(tmp_path):
    run = tiny_run(tmp_path, cuda_graphs=True)
    batch = packed_batch()
    n = batch.target_ids.numel()
    step = micro_step_fn(run, fused_target_loss_sum)
    ref_loss, ref_grads = loss_and_grads(run, batch, n, fused_target_loss_sum)
    for p in lora_parameters(run.model):
        p.grad = None
    loss = step(batch, n)
    assert loss.item() == ref_loss.item()
    assert all(torch.equal(p.grad, r) for p, r in zip(lora_parameters(run.model), ref_grads))


@pytest.mark.parametrize("change,reason", [
    ({"scaler": object()}, "fp16 with loss scaling: graphed steps are bf16 only"),
    ({"precision": "fp32"}, "fp32: flash varlen attention needs bf16"),
    ({"packing": False}, "packing is off"),
])
def test_graphs_unsupported_names_the_reason(change, reason, tmp_path):
    run = tiny_run(tmp_path, **{k: v for k, v in change.items() if k == "packing"})
    run.precision = change.get("precision", "bf16")
    run.scaler = change.get("scaler")
    assert graphs_unsupported(run, fused_target_loss_sum) == reason
    run.precision, run.scaler, run.cfg.packing = "bf16", None, True
    assert graphs_unsupported(run, lambda *a: None) == "unknown loss function"


def test_checkpointed_micro_batches_stay_graphed_further_up():
    """W2's 16-example micro-batch (~2,900 tokens, ~82 TFLOP): eager without checkpointing
    (the GPU outruns the host), graphed with it (the host dispatches each forward twice)."""
    from hivetune.plan.graph_sizes import launch_bound
    from hivetune.workflows.workloads import WORKLOADS

    weights = WORKLOADS["W2"].args.linear_weight_count
    assert not launch_bound(weights, 2_900) and launch_bound(weights, 2_900, checkpointing=True)
    assert launch_bound(weights, 2_000) and not launch_bound(weights, 4_500, checkpointing=True)


def test_planned_keys_are_the_keys_the_loop_meets(tmp_path):
    """The graphs captured up front (from example lengths) are those the micro-batches ask for."""
    run = tiny_run(tmp_path, cap=0, batch_size=3, grad_accum=2, max_steps=5)
    met = {batch_key(b, 32) for step in run.steps for b in micro_batches(run, step)}
    assert planned_keys(run, 32) == sorted(met)
    assert len(met) > 2


@pytest.mark.parametrize("rank", [0, 1])
def test_planned_keys_under_ddp_are_the_rank_shares(tmp_path, rank):
    """Under torchrun each rank meets the micro-batches of its token-balanced share of a step:
    those are the keys to capture up front (not the step cut in order)."""
    from hivetune.parallel.distributed import Dist

    run = tiny_run(tmp_path, cap=0, batch_size=3, grad_accum=2, max_steps=5)
    run.parallel = Dist(rank, 2, rank)
    lengths = run.data.lengths
    met = {batch_key(b, 32) for step in run.steps for b in micro_batches(run, run.parallel.shard(step, lengths))}
    assert planned_keys(run, 32) == sorted(met)
    whole_steps = {batch_key(b, 32) for step in run.steps for b in micro_batches(run, step)}
    assert whole_steps != met  # the one-process plan would capture the wrong graphs here


def test_ranks_agree_at_start_only_where_every_rank_has_a_first_micro_batch(tmp_path):
    """The graphs' first-call collectives need every rank to make its first call in the same
    step: not so when a rank's share of the run's first step is empty (a resumed run starting at
    an epoch's 1-example last step), nor past the plan; one process always."""
    from hivetune.parallel.distributed import Dist
    from hivetune.train.graph_plan import ranks_agree_at_start

    run = tiny_run(tmp_path, cap=0, batch_size=3, grad_accum=2, max_steps=5)
    assert ranks_agree_at_start(run)
    steps = run.steps
    for rank in (0, 1):
        run.parallel, run.start_step, run.steps = Dist(rank, 2, rank), 0, steps
        assert ranks_agree_at_start(run)
        run.steps = [[steps[0][0]], *steps[1:]]  # one example: one rank's share is empty
        assert run.parallel.shard(run.steps[0], run.data.lengths) == ([run.steps[0][0]] if rank == 0 else [])
        assert not ranks_agree_at_start(run)
        run.start_step = 1
        assert ranks_agree_at_start(run)
        run.start_step = len(run.steps)
        assert not ranks_agree_at_start(run)


def _plan_cost(sizes, tokens, capture):
    return capture * len(sizes) + sum(min(s for s in sizes if s > t) - t for t in tokens)


@pytest.mark.parametrize("seed", range(6))
def test_plan_sizes_is_the_cheapest_set_of_graph_sizes(seed):
    """Against brute force over every set of grain-rounded sizes that holds the largest count."""
    import itertools
    import random

    from hivetune.plan.graph_sizes import plan_sizes

    rng = random.Random(seed)
    tokens = [rng.randint(100, 900) for _ in range(rng.randint(5, 40))]
    capture = rng.choice([0, 50, 400, 3000, 10**6])
    sizes = plan_sizes(tokens, capture, grain=64)
    assert all(s % 64 == 0 for s in sizes) and all(any(s > t for s in sizes) for t in tokens)
    need = sorted({bucket_tokens(t, 64) for t in tokens})
    best = min(_plan_cost(list(c) + [need[-1]], tokens, capture)
               for k in range(len(need)) for c in itertools.combinations(need[:-1], k))
    assert _plan_cost(sizes, tokens, capture) == best
    if capture == 0:
        assert sizes == need
    if capture == 10**6:
        assert sizes == [need[-1]]


def test_capture_cost_rounds_down_to_a_power_of_two():
    """The planner's capture cost: capture seconds over GPU seconds a token, rounded down to a
    power of two (a slow first capture must not double it: W1's 3-graph plan), at least 1."""
    assert capture_cost_tokens(0.156, 9.5e-6) == 16384  # 16,421
    assert capture_cost_tokens(0.30, 9.5e-6) == 16384  # 31,579: rounded to the nearest it was 32,768
    assert capture_cost_tokens(0.32, 9.5e-6) == 32768
    assert capture_cost_tokens(0.1, 1e-3) == 64  # 100
    assert capture_cost_tokens(0.0, 1e-5) == 1 and capture_cost_tokens(0.1, 0.0) == 2.0 ** 26


def test_planned_micro_batches_are_what_the_loop_meets(tmp_path):
    from hivetune.train.graph_plan import planned_micro_batches

    run = tiny_run(tmp_path, batch_size=3, grad_accum=2, max_steps=4)
    met = [(b.input_ids.shape[1], len(b.layout.cu_seqlens) + 1) for step in run.steps for b in micro_batches(run, step)]
    assert planned_micro_batches(run) == met


def test_paced_micro_batches_are_the_slowest_rank_s_counts(tmp_path):
    """paced=True: at each place of each step, the most tokens any rank has there (this rank's
    segment count kept); one process: its own counts."""
    import dataclasses

    from hivetune.parallel.distributed import Dist
    from hivetune.train.graph_plan import planned_micro_batches

    run = tiny_run(tmp_path, cap=0, batch_size=3, grad_accum=2, max_steps=5)
    assert planned_micro_batches(run, paced=True) == planned_micro_batches(run)
    run.cfg = dataclasses.replace(run.cfg, batch_size=2)  # 6 examples a step: 3 a rank, 2 micro-batches
    own = []
    for rank in (0, 1):
        run.parallel = Dist(rank, 2, rank)
        own.append(planned_micro_batches(run))
    for rank in (0, 1):
        run.parallel = Dist(rank, 2, rank)
        paced = planned_micro_batches(run, paced=True)
        assert [s for _, s in paced] == [s for _, s in own[rank]]
        assert [t for t, _ in paced] == [max(a, b) for (a, _), (b, _) in zip(*own)]
    assert any(a != b for (a, _), (b, _) in zip(*own))  # the ranks' counts do differ


def w2_rank_counts(batch_order: str = "random") -> tuple[list[list[int]], list[list[int]]]:
    """W2 on 2 ranks (93 steps of 8 + 8 examples): each rank's micro-batch token counts, its own
    and paced (the most any rank has at that place)."""
    import dataclasses
    import tempfile

    from hivetune.workflows.workloads import WORKLOADS
    from hivetune.parallel.distributed import Dist
    from hivetune.train.graph_plan import planned_micro_batches

    w = WORKLOADS["W2"]
    examples = TokenizedExamples(workload_examples(w.n_examples, w.args.vocab_size, w.cap))
    values = {"model": "random", "data": "generator", "precision": "fp32", "device": "cpu", "epochs": 1.0,
              "batch_size": 16, "lora": w.lora, "eval_prompts": 0, "max_length": 4096, "batch_order": batch_order}
    model = random_model(qwen25_shape(w.args.vocab_size, 64, 128, 1, 4, 2, True), "cpu", torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        run = assemble(load_config(None, values), model, examples, None, torch.device("cpu"), "fp32",
                       Path(tmp) / "run", Path("random"))
    run.cfg = dataclasses.replace(run.cfg, batch_size=8)  # as benchmarks/multi_gpu.py: 8 a rank
    own, paced = [], []
    for rank in (0, 1):
        run.parallel = Dist(rank, 2, rank)
        own.append([t for t, _ in planned_micro_batches(run)])
        paced.append([t for t, _ in planned_micro_batches(run, paced=True)])
    return own, paced


def size_of(sizes, tokens):
    return min(s for s in sizes if s > tokens)


def test_w2_ranks_planning_on_paced_counts_choose_the_same_sizes():
    """W2 on 2 ranks, a capture costed at 2,048 tokens: planned on their own counts the ranks
    choose different sizes and the slower rank's graphs sum to 142,768 tokens; on the paced
    counts both choose the same three, summing to 142,144 (at the 64-token grain before 16:
    four, 141,248, one capture more)."""
    from hivetune.plan.graph_sizes import plan_sizes

    own, paced = w2_rank_counts()
    sizes_own = [plan_sizes(counts, 2048) for counts in own]
    assert sizes_own == [[1424, 1568, 1728], [1360, 1472, 1568, 1728]]
    assert sum(max(size_of(sizes_own[0], a), size_of(sizes_own[1], b)) for a, b in zip(*own)) == 142_768
    sizes_paced = [plan_sizes(counts, 2048) for counts in paced]
    assert sizes_paced == [[1424, 1568, 1728]] * 2
    assert sum(size_of(sizes_paced[0], t) for t in paced[0]) == 142_144
    assert plan_sizes(paced[0], 2048, grain=64) == [1408, 1536, 1600, 1728]
    assert sum(size_of([1408, 1536, 1600, 1728], t) for t in paced[0]) == 141_248


def test_w2_balanced_batch_order_takes_one_size_and_pads_less():
    """batch_order=balanced on W2 (the same 1,500 examples, each step's 16 dealt by length, step
    totals evened): every rank's micro-batch holds 1,443-1,453 tokens, so one graph size holds
    them all, and the slower rank's graphs sum to 135,408 tokens (the real tokens: 134,799)
    against random order's 142,144 with three; at the 64-token grain, 136,896."""
    from hivetune.plan.graph_sizes import plan_sizes

    own, paced = w2_rank_counts("balanced")
    assert sum(own[0]) + sum(own[1]) == sum(sum(c) for c in w2_rank_counts()[0])  # the same tokens
    assert (min(own[0] + own[1]), max(own[0] + own[1])) == (1443, 1453)
    assert (min(paced[0]), max(paced[0]), sum(paced[0])) == (1448, 1453, 134_799)
    sizes = plan_sizes(paced[0], 2048)
    assert sizes == plan_sizes(paced[1], 2048) == [1456]
    assert sum(size_of(sizes, t) for t in paced[0]) == 135_408
    assert plan_sizes(paced[0], 2048, grain=64) == [1472]
    assert sum(size_of([1472], t) for t in paced[0]) == 136_896


def test_captures_are_deferred_where_a_replay_covers_a_quarter_of_a_capture():
    """W2 under DDP (~0.083-0.1 s a replay, 0.1-0.24 s a capture): one capture after each
    replay; W1 (~17 ms a replay, ~0.14 s a capture): all at the first micro-batch."""
    assert defers_captures(0.23, 0.1) and defers_captures(0.4, 0.1) and defers_captures(0.24, 0.083)
    assert not defers_captures(0.14, 0.017) and not defers_captures(0.41, 0.1)


def test_size_uses_count_the_micro_batches_each_size_takes():
    """Deferred captures go in the order of size_uses: the smallest planned size of a micro-batch's
    segment count above its tokens; a micro-batch no size holds counts for none."""
    from hivetune.plan.graph_sizes import size_uses

    sizes = {10: [1536, 1408, 1728], 6: [512]}
    micro = [(1400, 10), (1300, 10), (1500, 10), (1450, 10), (1700, 10), (1000, 10), (400, 6), (512, 6), (90, 3)]
    assert size_uses(sizes, micro) == {(1408, 10): 3, (1536, 10): 2, (1728, 10): 1, (512, 6): 1}


def test_a_deferred_capture_counts_a_quarter_in_the_plan():
    """W4's 100 micro-batches (the balanced step order puts most at 8,150-8,190 tokens) at its
    measured capture cost (0.3 s a capture, 1.7e-5 s a token: 16,384 tokens): 2 sizes and 25,526
    pad tokens captured at once; deferred, a capture counts a quarter: 4 sizes, 9,318 pad tokens."""
    from hivetune.plan.graph_sizes import DEFERRED_CAPTURE_SHARE, plan_sizes

    from hivetune.data.step_plan import plan_steps
    from hivetune.workflows.workloads import WORKLOADS

    lengths = list(WORKLOADS["W4"].data().lengths)
    tokens = [sum(lengths[i] for i in step) for step in plan_steps(len(lengths), 8, 1.0, 0, 0, lengths, "balanced")]
    assert len(tokens) == 100 and sum(tokens) == 831_370
    pads = []
    for share in (1.0, DEFERRED_CAPTURE_SHARE):
        sizes = plan_sizes(tokens, capture_cost_tokens(0.3 * share, 1.7e-5))
        pads.append((sizes, sum(next(s for s in sizes if s > t) - t for t in tokens)))
    assert pads == [([8208, 9712], 25_526), ([8192, 8416, 8944, 9712], 9_318)]


def test_each_segment_counts_largest_size_is_captured_at_once():
    """Deferred captures wait for all sizes but each segment count's largest: a micro-batch of
    another segment count (a step's short last micro-batch) still finds a planned graph."""
    keys = [(1728, 10), (1600, 10), (1408, 10), (896, 7), (768, 7)]
    assert deferrable(keys) == {(1600, 10), (1408, 10), (768, 7)}
    assert deferrable([(1728, 10)]) == set() and deferrable([]) == set()


def test_pad_packed_batch_to_a_target_capacity():
    """targets=: the target rows padded to that many (IGNORE_INDEX, the last pad token), not to
    one a token; fewer than the batch's own targets is refused."""
    batch = packed_batch()
    n = batch.target_ids.numel()
    padded = pad_packed_batch(batch, 256, pad_id=7, targets=n + 3)
    assert padded.input_ids.shape == (1, 256) and padded.target_ids.numel() == padded.target_index.numel() == n + 3
    assert padded.target_ids[:n].equal(batch.target_ids) and padded.target_ids[n:].eq(IGNORE_INDEX).all()
    assert padded.target_index[n:].eq(255).all()
    with pytest.raises(ValueError, match=f"bucket of {n - 1} targets cannot hold {n} targets"):
        pad_packed_batch(batch, 256, targets=n - 1)


def test_target_capacities_hold_each_micro_batch_in_the_size_it_takes():
    """Each size holds the most targets of the micro-batches whose tokens it is the smallest size
    above; each segment count's largest size holds the most of all its micro-batches; never more
    than a target a token."""
    from hivetune.plan.graph_sizes import target_capacities

    sizes = {10: [1408, 1536, 1728], 6: [512]}
    micro = [(1400, 10), (1300, 10), (1500, 10), (1450, 10), (1700, 10), (400, 6)]
    targets = [900, 1000, 950, 1100, 1200, 380]
    capacity = target_capacities(sizes, micro, targets)
    assert capacity == {(1408, 10): 1000, (1536, 10): 1100, (1728, 10): 1200, (512, 6): 380}
    assert target_capacities({10: [1408]}, [(1400, 10)], [1500]) == {(1408, 10): 1408}
    assert target_capacities({10: [1408, 1536]}, [(1500, 10)], [700]) == {(1536, 10): 700}


def test_planned_micro_targets_are_what_the_loop_meets(tmp_path):
    from hivetune.train.graph_plan import planned_micro_batches, planned_micro_targets

    run = tiny_run(tmp_path, batch_size=3, grad_accum=2, max_steps=4)
    met = [b.target_ids.numel() for step in run.steps for b in micro_batches(run, step)]
    assert planned_micro_targets(run) == met and len(met) == len(planned_micro_batches(run)) > 4


def test_preload_captures_the_model_cut_to_its_first_layers(monkeypatch):
    """The preload's captures (GraphedForwardBackward._preload) see the model cut to
    PRELOAD_LAYERS layers (2: the second layer's backward has the input-gradient products the
    first layer's lacks), one capture per deferred key into that key's bucket; the model gets
    all its layers back after, and a failed capture still restores them."""
    from types import SimpleNamespace

    from hivetune.train import replay
    expected = replay.PRELOAD_LAYERS
    layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))
    model = SimpleNamespace(model=SimpleNamespace(layers=layers))
    seen = []
    graphed = object.__new__(replay.GraphedForwardBackward)
    graphed.model, graphed.preloaded, graphed.stats = model, {}, {}
    graphed._new_bucket = lambda key: ("bucket", key)
    graphed._record = lambda graph, bucket: seen.append((bucket, list(model.model.layers)))
    monkeypatch.setattr(replay, "keeps_graphs", lambda: False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda *a, **k: object())
    graphed._preload([(1600, 10), (1408, 10)])
    assert [bucket for bucket, _ in seen] == [("bucket", (1600, 10)), ("bucket", (1408, 10))]
    assert expected == 2 and all(cut == list(layers)[:expected] for _, cut in seen)
    assert model.model.layers is layers and graphed.stats["preloaded"] == 2

    failures = []
    graphed._record = lambda graph, bucket: 1 / 0
    graphed._capture_failed = failures.append
    graphed._preload([(1344, 10)])
    assert model.model.layers is layers
    assert failures == [f"a preload capture (the first {expected} layers) of a 1344-token bucket failed: "
                        "ZeroDivisionError: division by zero"]
