"""hivetune eval on the tiny model: loss parity with training, batched generation, base == LoRA
off, eval.json / eval.md, overwrite and bad-input handling (the text scores: test_eval_metrics.py)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ops_records, write_jsonl
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.workflows.eval_examples import read_examples
from hivetune.workflows.eval_scoring import generate_sorted, score_model

EVAL_ARGS = ["--max-new-tokens", "8", "--batch-size", "4", "--precision", "fp32", "--device", "cpu"]


def eval_records() -> list[dict]:
    """Prompts of different lengths; commands from the field, from `$ ` lines, or none."""
    records = []
    for i, r in enumerate(ops_records(7)):
        svc = r["output"].split("`")[1].split()[-1]
        r["instruction"] = r["instruction"] + " Please explain." * (i % 4)
        r["output"] = f"Restart it:\n$ sudo systemctl restart {svc}\nThen check it."
        if i % 3 == 1:
            r["command"] = f"systemctl restart {svc}"
        elif i % 3 == 2:
            r["output"] = "Ask the administrator."
        records.append(r)
    return records


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A run folder whose adapter has random B ~ N(0, 1): the tiny model's greedy answers vary
    token to token (with B = 0, or after a few training steps, they repeat one token)."""
    from hivetune.model.load import load_model
    from hivetune.model.lora import LoRASpec, apply_lora, lora_modules, save_adapter

    root = tmp_path_factory.mktemp("eval")
    model = load_model(tiny_model_dir)
    spec = LoRASpec(r=4, alpha=8, dropout=0.0)
    torch.manual_seed(0)
    apply_lora(model, spec)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.weight.normal_(0, 1.0)
    save_adapter(model, spec, root / "run" / "adapter", str(tiny_model_dir))
    return root / "run", write_jsonl(root / "heldout.jsonl", eval_records())


@pytest.fixture(scope="module")
def report(trained, tiny_model_dir):
    from hivetune.workflows.evaluate import evaluate

    run, data = trained
    return evaluate(model=str(tiny_model_dir), adapter=str(run), data=str(data), max_new_tokens=8,
                    batch_size=4, precision="fp32", device="cpu")


@pytest.fixture(scope="module")
def tuned_model(trained, tiny_model_dir):
    from hivetune.model.load import load_model
    from hivetune.model.lora import load_adapter
    from hivetune.model.tokenizer import load_tokenizer

    model = load_model(tiny_model_dir)
    load_adapter(model, trained[0] / "adapter")
    return model.eval(), load_tokenizer(str(tiny_model_dir))


def test_loss_equals_training_loss(report, trained, tuned_model):
    """Per-example and mean loss come from training's encoding, batching and loss op."""
    from hivetune.data.batch import collate_packed
    from hivetune.data.dataset import index_dataset
    from hivetune.model.lora import lora_enabled
    from hivetune.ops.loss import target_loss_sum

    model, tokenizer = tuned_model
    data = index_dataset(trained[1], "auto", tokenizer, 1024, False)
    examples = [data.example(i) for i in range(len(data))]
    assert len(examples) == report["examples"] == 7
    for side in ("base", "tuned"):
        with torch.no_grad(), lora_enabled(model, side == "tuned"):
            for e, row in zip(examples, report["rows"]):
                b = collate_packed([e])
                total = target_loss_sum(model(b.input_ids, b.position_ids, b.layout), model.lm_head.weight,
                                        b.target_index, b.target_ids)
                assert row[side]["response_tokens"] == e.n_targets
                assert row[side]["loss"] == pytest.approx(float(total) / e.n_targets, rel=1e-5)
            b = collate_packed(examples)  # one optimizer step's loss: sum over targets / target count
            step_loss = target_loss_sum(model(b.input_ids, b.position_ids, b.layout), model.lm_head.weight,
                                        b.target_index, b.target_ids) / sum(e.n_targets for e in examples)
        means = report["means"][side]
        assert means["loss"] == pytest.approx(float(step_loss), rel=1e-5)
        assert means["perplexity"] == pytest.approx(float(step_loss.exp()), rel=1e-5)
    assert report["means"]["tuned"]["loss"] != pytest.approx(report["means"]["base"]["loss"], rel=1e-4)


def test_batched_generation_equals_one_by_one(trained, tuned_model):
    from hivetune.workflows.generate import encode_prompt, greedy_ids

    model, tokenizer = tuned_model
    examples = read_examples(trained[1], tokenizer, 1024)
    prompts = [e.prompt_ids for e in examples]
    assert len({len(p) for p in prompts}) >= 3
    # alpaca prompts are what `hivetune generate` sends for the same question
    assert prompts[0] == encode_prompt(tokenizer, examples[0].question, chat=True)
    single = [greedy_ids(model, [p], 10, set())[0] for p in prompts]
    assert generate_sorted(model, prompts, 10, set(), batch_size=4) == single
    # a stop token mid-answer ends that row only; other rows run on, and its later tokens are dropped
    stop = single[0][4]
    expected = [s[:s.index(stop)] if stop in s else s for s in single]
    assert any(len(x) < 10 for x in expected) and any(len(x) == 10 for x in expected)
    assert generate_sorted(model, prompts, 10, {stop}, batch_size=4) == expected
    assert generate_sorted(model, prompts, 10, {stop}, batch_size=1) == expected


def test_one_pass_losses_and_answers_equal_the_two_passes(trained, tuned_model):
    """The loss pass's prompt keys and values seed the decoding (KVCache.prefix): same losses as
    response_losses, same answers as greedy decoding of each prompt alone, stop tokens included."""
    from hivetune.workflows.eval_scoring import losses_and_answers, response_losses
    from hivetune.workflows.generate import greedy_ids

    model, tokenizer = tuned_model
    examples = read_examples(trained[1], tokenizer, 1024)
    single = [greedy_ids(model, [e.prompt_ids], 10, set())[0] for e in examples]
    stop = {single[0][4]}
    expected = [greedy_ids(model, [e.prompt_ids], 10, stop)[0] for e in examples]
    assert any(len(x) < 10 for x in expected) and any(len(x) == 10 for x in expected)
    reference = response_losses(model, [e.encoded for e in examples], batch_size=4)
    for batch_size in (3, 16):
        seconds: dict = {}
        losses, answers = losses_and_answers(model, examples, 10, stop, batch_size, seconds)
        assert answers == expected
        assert [n for _, n in losses] == [n for _, n in reference]
        assert [s for s, _ in losses] == pytest.approx([s for s, _ in reference], rel=1e-5)
        assert set(seconds) == {"loss", "generate"}


def test_merged_lora_is_the_tuned_model(trained, tuned_model):
    """The tuned side runs merged (W + s B A): same answers and losses as the LoRA path in fp32,
    and the base weights are exactly back afterwards."""
    from hivetune.model.lora import lora_modules
    from hivetune.workflows.eval_scoring import merged_lora

    model, tokenizer = tuned_model
    examples = read_examples(trained[1], tokenizer, 1024)
    before = {n: m.base_layer.weight.detach().clone() for n, m in lora_modules(model)}
    unmerged = score_model(model, tokenizer, examples, 8, batch_size=4)
    with merged_lora(model):
        assert not any(m.enabled for _, m in lora_modules(model))
        merged = score_model(model, tokenizer, examples, 8, batch_size=4)
    for a, b in zip(unmerged, merged):
        assert a["generation"] == b["generation"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for n, m in lora_modules(model):
        assert m.enabled and torch.equal(m.base_layer.weight, before[n])


def test_base_equals_model_without_lora(report, trained, tiny_model_dir):
    """Base rows (LoRA switched off) equal the plain base model's, which has no LoRA at all."""
    from hivetune.model.load import load_model
    from hivetune.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    plain = load_model(tiny_model_dir).eval()
    rows = score_model(plain, tokenizer, read_examples(trained[1], tokenizer, 1024), 8, batch_size=4)
    for row, got in zip(rows, report["rows"]):
        assert got["base"]["generation"] == row["generation"]
        assert got["base"]["loss"] == pytest.approx(row["loss"], rel=1e-6)
        assert got["base"]["f1"] == row["f1"] and got["base"]["command_hit"] == row["command_hit"]
    assert [r["tuned"]["loss"] for r in report["rows"]] != [r["loss"] for r in rows]


def test_eval_json_and_md(report, trained):
    run, data = trained
    out = run / "eval"
    assert report["out"] == str(out)
    saved = json.loads((out / "eval.json").read_text())
    assert saved == {k: v for k, v in report.items() if k != "out"}
    assert set(saved) >= {"model", "adapter", "data", "device", "precision", "max_new_tokens", "examples",
                          "seconds", "means", "rows"}
    assert saved["adapter"] == str(run / "adapter") and saved["precision"] == "fp32"
    assert len(saved["rows"]) == 7 and saved["rows"][1]["where"] == f"{data}:2"
    row_keys = {"loss", "perplexity", "loss_sum", "response_tokens", "generation", "generated_tokens",
                "exact_match", "f1", "rouge_l", "command_hit"}
    for row in saved["rows"]:
        assert set(row["base"]) == set(row["tuned"]) == row_keys
        assert 0 < row["tuned"]["generated_tokens"] <= 8 or row["tuned"]["generation"] == ""
    # commands: field (i % 3 == 1), `$ ` lines (i % 3 == 0), none (i % 3 == 2)
    assert saved["rows"][0]["commands"] == ["sudo systemctl restart nginx"]
    assert saved["rows"][1]["commands"] == ["systemctl restart sshd"]
    assert saved["rows"][2]["commands"] == [] and saved["rows"][2]["base"]["command_hit"] is None
    for side in ("base", "tuned"):
        means, rows = saved["means"][side], [r[side] for r in saved["rows"]]
        assert means["f1"] == pytest.approx(sum(r["f1"] for r in rows) / 7)
        assert means["rouge_l"] == pytest.approx(sum(r["rouge_l"] for r in rows) / 7)
        assert means["command_examples"] == 5 and means["command_hits"] == sum(bool(r["command_hit"]) for r in rows)
        assert means["response_tokens"] == sum(r["response_tokens"] for r in rows)
    md = (out / "eval.md").read_text()
    assert "| metric | base | tuned | change |" in md and "| command hit |" in md
    assert f"## {data}:1" in md and f"## {data}:4" not in md  # three examples side by side
    assert md.count("| answer | ") == 3


def test_cli_refuses_overwrite_unless_force(trained, tiny_model_dir, tmp_path, capsys):
    run, data = trained
    out = tmp_path / "out"
    # no --model: the base the adapter names (base_model_name_or_path)
    args = ["eval", "--adapter", str(run / "adapter"), "--data", str(data), "--out", str(out), *EVAL_ARGS]
    assert main(args + ["--limit", "1"]) == 0
    assert "| response loss |" in capsys.readouterr().out
    before = (out / "eval.json").read_bytes()
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == (
        f"hivetune: error: --out: {out} already holds eval.json and eval.md; pass --force to overwrite")
    assert (out / "eval.json").read_bytes() == before
    assert main(args + ["--force", "--limit", "2"]) == 0
    saved = json.loads((out / "eval.json").read_text())
    assert saved["examples"] == 2 and saved["model"] == str(tiny_model_dir)
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.md"]  # no temporary files left


@pytest.mark.parametrize("case", ["missing_run", "not_a_run", "bad_json", "text_format", "undetectable", "bad_command",
                                  "no_limit"])
def test_bad_input_is_one_line_exit_2_nothing_written(case, trained, tiny_model_dir, tmp_path, capsys):
    run, _ = trained
    data = write_jsonl(tmp_path / "d.jsonl", eval_records())
    out = tmp_path / "out"
    args = ["eval", "--model", str(tiny_model_dir), "--adapter", str(run), "--data", str(data), "--out", str(out),
            *EVAL_ARGS]
    expected = {
        "missing_run": f"{tmp_path / 'nope'}: adapter or run folder not found",
        "not_a_run": f"{tmp_path}: no finished adapter (adapter_config.json) in this folder",
        "bad_json": f"{data}:3: malformed JSON (Expecting property name enclosed in double quotes at column 2)",
        "text_format": f"{data}:1: eval needs prompt/response records (alpaca or chat), not text",
        # training's message, without its advice to set `format` (eval has no such option)
        "undetectable": f"{data}:1: cannot tell the format (expected 'messages', 'instruction'+'output' or 'text')",
        "bad_command": f"{data}:2: field 'command' must be a non-empty string or a list of them",
        "no_limit": "--limit: must be >= 0, got -1",
    }[case]
    if case == "missing_run":
        args[4] = str(tmp_path / "nope")
    elif case == "not_a_run":
        args[4] = str(tmp_path)
    elif case == "bad_json":
        lines = data.read_text().splitlines()
        lines[2] = "{oops"
        data.write_text("\n".join(lines) + "\n")
    elif case == "text_format":
        write_jsonl(data, [{"text": "just text"}])
    elif case == "undetectable":
        write_jsonl(data, [{"prompt": "a", "completion": "b"}])
    elif case == "bad_command":
        records = eval_records()
        records[1]["command"] = ""
        write_jsonl(data, records)
    elif case == "no_limit":
        args += ["--limit", "-1"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"hivetune: error: {expected}"]
    assert not out.exists()


def test_train_ends_with_the_ab_that_eval_gives(tiny_model_dir, tmp_path, capsys):
    """`hivetune train` with a held-out file scores base vs tuned on the model in memory into
    RUN/eval/; `hivetune eval` on the saved adapter gives the same rows."""
    data = write_jsonl(tmp_path / "train.jsonl", eval_records() * 2)  # the held-out answers: the loss must drop
    heldout = write_jsonl(tmp_path / "heldout.jsonl", eval_records())
    run = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(data), "--val-data", str(heldout),
                 "--output", str(run), "--max-steps", "3", "--batch-size", "4", "--lr", "1e-2", "--precision", "fp32",
                 "--device", "cpu", "--quiet", "--set", "lora.r=4", "--set", "max_new_tokens=6",
                 "--set", "eval_examples=5", "--set", "eval_prompts=2"]) == 0
    out = capsys.readouterr().out
    assert f"base vs tuned on 5 held-out examples of {heldout}" in out and "| response loss |" in out
    assert out.count("held-out question:") == 2
    in_run = json.loads((run / "eval" / "eval.json").read_text())
    assert in_run["examples"] == 5 and in_run["max_new_tokens"] == 6 and (run / "eval" / "eval.md").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["means"] == in_run["means"] and summary["eval"]["out"] == str(run / "eval")
    assert summary["samples"][1]["tuned"] == in_run["rows"][1]["tuned"]["generation"]
    assert {"python", "torch", "hivetune", "cpu"} <= set(summary["environment"])

    # No --max-new-tokens: eval takes the run's (6), so it gives the run's answers.
    assert main(["eval", "--adapter", str(run), "--data", str(heldout), "--out", str(tmp_path / "again"),
                 "--limit", "5", *EVAL_ARGS[2:]]) == 0
    again = json.loads((tmp_path / "again" / "eval.json").read_text())
    assert again["max_new_tokens"] == 6
    for a, b in zip(in_run["rows"], again["rows"]):
        for side in ("base", "tuned"):
            assert a[side]["generation"] == b[side]["generation"]
            assert a[side]["loss"] == pytest.approx(b[side]["loss"], rel=1e-6)
    assert in_run["means"]["tuned"]["loss"] < in_run["means"]["base"]["loss"] - 0.1


@pytest.mark.default_job
@pytest.mark.slow
def test_default_job_tuned_beats_base(tmp_path):
    """`hivetune train` with no arguments (the embedded SmolLM2 on the shipped data) ends with the
    A/B on the shipped held-out split, and the tuned model beats the base by a wide margin on
    response loss and on command hits. If it does not, the default recipe or data is wrong.
    Measured on a 2-core CPU: loss 3.66 -> 0.35, hits 1 -> 16 of 40
    (benchmarks/results/default-job-cpu.jsonl).
    It takes about 4 minutes there: select it alone with `-m default_job`, leave it out with
    `-m "not default_job"`."""
    import subprocess
    import sys

    from hivetune.core.embedded import embedded_model_path

    try:
        embedded_model_path()
    except UserError as e:
        pytest.skip(str(e))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hivetune", "train", "--output", str(run), "--quiet"],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "base vs tuned on 40 held-out examples" in proc.stdout and "| command hit |" in proc.stdout
    report = json.loads((run / "eval" / "eval.json").read_text())
    assert report["examples"] == 40 and report["data"].endswith("heldout.jsonl")
    base, tuned = report["means"]["base"], report["means"]["tuned"]
    assert base["command_examples"] == tuned["command_examples"] == 40
    assert tuned["loss"] < base["loss"] / 2, (base["loss"], tuned["loss"])
    assert tuned["command_hits"] >= base["command_hits"] + 10, (base["command_hits"], tuned["command_hits"])
