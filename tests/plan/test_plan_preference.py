"""`hivetune plan` for method dpo / orpo: the pair data (the shipped pairs when none is given), one
shared row a pair, steps timed as graphed where train.pair_graph replays them, and the reference
pass's third more work for dpo."""

from __future__ import annotations

import pytest

from conftest import write_jsonl
from hivetune.core.config import load_config
from hivetune.core.embedded import DEFAULT_DATA_DIR
from hivetune.data.pairs import PAIR_FILES, index_pairs
from hivetune.model.tokenizer import load_tokenizer
from hivetune.plan import plan
from hivetune.plan.timing import DISPATCH_S_PER_LAYER, GRAPHED_DISPATCH_S_PER_LAYER


def pairs(n: int) -> list[dict]:
    return [{"prompt": "restart the web server " * (1 + i % 5), "chosen": "systemctl restart nginx " * (1 + i % 3),
             "rejected": "reboot " * (1 + i % 7)} for i in range(n)]


def cfg_of(model, data, **values):
    return load_config(None, {"model": str(model), "data": str(data), "batch_size": 4, **values})


def test_dpo_plan_sizes_the_longest_shared_rows_and_a_third_more_time(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(30))
    index = index_pairs(data, load_tokenizer(str(tiny_model_dir)), 2048)
    rows = sorted((len(e) for e in index.pairs), reverse=True)
    dpo = plan(cfg_of(tiny_model_dir, data, method="dpo"), gpu="H200")
    orpo = plan(cfg_of(tiny_model_dir, data, method="orpo"), gpu="H200")
    assert (dpo.examples, dpo.tokens_per_epoch) == (30, sum(rows))
    assert dpo.micro_batch_tokens == sum(rows[:4]) and not dpo.cuda_graphs
    assert dpo.step_seconds == pytest.approx(orpo.step_seconds * 4 / 3, rel=1e-12)
    assert any(n.startswith("method dpo: one row a pair, [prompt, chosen, rejected]; steps replayed from one CUDA "
                            "graph") for n in dpo.notes)
    # a tiny model is launch-bound: eager steps take the eager dispatch time, graphed ones the replay's
    eager = plan(cfg_of(tiny_model_dir, data, method="dpo", cuda_graphs=False), gpu="H200")
    assert eager.step_seconds == pytest.approx(dpo.step_seconds * DISPATCH_S_PER_LAYER / GRAPHED_DISPATCH_S_PER_LAYER)
    assert any(n.startswith("method dpo: one row a pair, [prompt, chosen, rejected]; eager steps") for n in eager.notes)
    plain = plan(cfg_of(tiny_model_dir, data, method="dpo", preference={"shared_prompt": False}), gpu="H200")
    widest = max(len(e.prompt) + max(len(e.chosen), len(e.rejected)) for e in index.pairs)
    assert plain.micro_batch_tokens == 2 * 4 * widest > dpo.micro_batch_tokens


def test_dpo_plan_without_data_reads_the_shipped_pairs():
    p = plan(load_config(None, {"method": "dpo", "batch_size": 8}), gpu="H200")
    shipped = DEFAULT_DATA_DIR / PAIR_FILES[0]
    n = sum(1 for line in shipped.read_text().splitlines() if line.strip())
    assert p.examples == n and str(shipped) in p.tokens_source
