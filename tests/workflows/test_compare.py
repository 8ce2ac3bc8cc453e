"""hivetune eval --candidate A --against B: identical sides tie everywhere, an adapter trained on
the held-out answers beats a barely trained one and the base, two adapters share one loaded
base, the compare.json layout, a GGUF side, bad input in one line."""

from __future__ import annotations

import json

import pytest

from conftest import build_tiny_model, build_tokenizer, write_jsonl
from hivetune.cli import main
from hivetune.core.config import load_config
from hivetune.core.errors import UserError
from hivetune.workflows.compare import compare

ARGS = {"max_new_tokens": 12, "batch_size": 4, "precision": "fp32", "device": "cpu"}
SET_KEYS = {"examples", "candidate", "against", "wins"}
METRIC_KEYS = {"loss", "perplexity", "exact_match", "token_f1", "rouge_l"}


def heldout_records() -> list[dict]:
    services = ["nginx", "sshd", "redis", "podman", "httpd", "chronyd"]
    return [{"instruction": f"Restart {s}?", "input": "", "output": f"systemctl restart {s}"} for s in services]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    heldout = write_jsonl(root / "heldout.jsonl", heldout_records())
    regression = write_jsonl(root / "regression.jsonl", [{"instruction": "List files?", "input": "",
                                                          "output": "ls -la"}] * 3)
    return root, heldout, regression


def trained_run(model_dir, data, out, steps: int):
    from hivetune.train.loop import fit
    from hivetune.train.setup import setup

    cfg = load_config(None, {"model": str(model_dir), "data": str(data), "output_dir": str(out),
                             "precision": "fp32", "device": "cpu", "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
                             "eval_prompts": 0, "batch_size": 6, "max_steps": steps, "lr": 2e-2,
                             "warmup_steps": 0, "threads": 1, "schedule": "constant"})
    fit(setup(cfg), progress=False)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, files):
    """A run trained 60 steps on the held-out answers themselves, and one trained 1 step. The
    model's weights are drawn with std 0.2: at 0.02 its tied embeddings bound every logit near 1,
    too little for LoRA alone to learn six answers token for token."""
    root, heldout, _ = files
    model_dir = tmp_path_factory.mktemp("compare-model")
    build_tokenizer(model_dir)
    build_tiny_model(model_dir, initializer_range=0.2)
    return (trained_run(model_dir, heldout, root / "good", 60),
            trained_run(model_dir, heldout, root / "weak", 1))


def test_identical_sides_give_identical_metrics_and_all_ties(runs, files, tmp_path):
    good, _ = runs
    report = compare(str(good), str(good), data=str(files[1]), regression=str(files[2]), out=str(tmp_path), **ARGS)
    on_disk = json.loads((tmp_path / "compare.json").read_text())
    assert set(on_disk) == {"candidate", "against", "engine", "sets"} and set(on_disk["sets"]) == {"heldout", "regression"}
    assert on_disk["engine"] == "hivetune"
    for name, n in (("heldout", 6), ("regression", 3)):
        entry = on_disk["sets"][name]
        assert set(entry) == SET_KEYS and set(entry["candidate"]) == METRIC_KEYS
        assert entry["examples"] == n and entry["candidate"] == entry["against"]
        assert entry["wins"] == {"candidate": 0, "against": 0, "ties": n}
    assert on_disk == {k: report[k] for k in on_disk}
    assert "| wins (token F1) | 0 | 0 | 6 ties |" in (tmp_path / "compare.md").read_text()


def test_trained_adapter_wins_and_two_adapters_share_one_base(runs, files, tmp_path, monkeypatch):
    import hivetune.model.load as load

    loads = []
    real = load.load_model
    monkeypatch.setattr(load, "load_model", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    good, weak = runs
    report = compare(str(good), str(weak), data=str(files[1]), out=str(tmp_path), **ARGS)
    assert len(loads) == 1  # the second adapter's weights were copied over the first's
    entry = report["sets"]["heldout"]
    assert "regression" not in report["sets"]
    assert entry["candidate"]["loss"] < entry["against"]["loss"]
    assert entry["candidate"]["token_f1"] > entry["against"]["token_f1"]
    assert entry["wins"]["candidate"] > entry["wins"]["against"]
    assert sum(entry["wins"].values()) == 6


def test_swapped_adapter_scores_as_a_fresh_load(runs, files, tmp_path):
    """The weak adapter copied over the good one scores exactly as the weak one loaded alone."""
    good, weak = runs
    swapped = compare(str(good), str(weak), data=str(files[1]), out=str(tmp_path / "a"), **ARGS)
    alone = compare(str(weak), "base", data=str(files[1]), out=str(tmp_path / "b"), **ARGS)
    assert swapped["sets"]["heldout"]["against"] == alone["sets"]["heldout"]["candidate"]


def test_trained_adapter_beats_the_base(runs, files, tmp_path):
    good, _ = runs
    report = compare(str(good / "adapter"), "base", data=str(files[1]), out=str(tmp_path), **ARGS)
    entry = report["sets"]["heldout"]
    assert entry["candidate"]["loss"] < entry["against"]["loss"]
    assert entry["wins"]["candidate"] > entry["wins"]["against"]


def test_a_gguf_side_scores_as_base_on_the_same_file(files, tmp_path):
    from hivetune.core.embedded import embedded_model_path

    gguf = str(embedded_model_path())
    report = compare(gguf, "base", model=gguf, data=str(files[1]), out=str(tmp_path), limit=2,
                     **{**ARGS, "max_new_tokens": 4})
    entry = report["sets"]["heldout"]
    assert entry["examples"] == 2 and entry["candidate"] == entry["against"]
    assert entry["wins"]["ties"] == 2 and entry["candidate"]["loss"] > 0


@pytest.fixture(scope="module")
def other_adapter(tmp_path_factory):
    """An adapter of another tiny model (same shapes, other weights: another base)."""
    from hivetune.model.load import load_model
    from hivetune.model.lora import LoRASpec, apply_lora, save_adapter

    folder = tmp_path_factory.mktemp("other")
    build_tokenizer(folder / "model")
    build_tiny_model(folder / "model", seed=1)
    net = load_model(folder / "model")
    spec = LoRASpec(r=8, alpha=16, dropout=0.0)
    apply_lora(net, spec)
    save_adapter(net, spec, folder / "adapter", str(folder / "model"))
    return folder / "adapter"


def test_bad_input_is_one_line_and_exit_2(runs, files, other_adapter, tmp_path, capsys):
    good, _ = runs
    cases = [
        (["--candidate", str(tmp_path / "nope"), "--against", "base"],
         f"--candidate: {tmp_path / 'nope'} not found (expected a run folder, an adapter folder, a merged HF "
         f"folder, a .gguf file or base)"),
        (["--candidate", str(good), "--against", str(other_adapter)],
         f"--against {other_adapter}: an adapter of base {other_adapter.parent / 'model'}, the candidate's base is "
         f"{json.loads((good / 'adapter' / 'adapter_config.json').read_text())['base_model_name_or_path']} "
         f"(compare adapters of one base, or pass --model)"),
        (["--candidate", str(good)], "eval: --candidate and --against go together (each a run folder, an adapter "
                                     "folder, a merged HF folder, a .gguf file or base)"),
        (["--candidate", str(good), "--against", "base", "--adapter", str(good)],
         "eval: --adapter is for base vs tuned; with --candidate / --against leave it out"),
    ]
    for argv, message in cases:
        assert main(["eval", *argv, "--data", str(files[1]), "--out", str(tmp_path / "out"),
                     "--device", "cpu"]) == 2
        assert capsys.readouterr().err.strip() == f"hivetune: error: {message}"
    assert not (tmp_path / "out").exists()


def test_cli_writes_and_refuses_to_overwrite(runs, files, tmp_path, capsys):
    good, weak = runs
    argv = ["eval", "--candidate", str(good), "--against", str(weak), "--data", str(files[1]),
            "--max-new-tokens", "4", "--precision", "fp32", "--device", "cpu"]
    assert main(argv + ["--out", str(tmp_path / "c")]) == 0
    assert "wrote " + str(tmp_path / "c") + "/compare.json and compare.md" in capsys.readouterr().out
    assert main(argv + ["--out", str(tmp_path / "c")]) == 2
    assert "already holds compare.json and compare.md; pass --force" in capsys.readouterr().err
    with pytest.raises(UserError, match="--out: name a folder"):
        compare("base", str(good), data=str(files[1]))
