"""train --init-adapter: LoRA starts as an earlier adapter (bitwise logits at step 0), the
optimizer fresh; mismatched base / rank / targets / alpha refused in one line; resume works."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import build_tiny_model, build_tokenizer, ops_records, write_jsonl
from hivetune.checkpoint import sha256_file
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.model.lora import lora_state_dict
from hivetune.train.loop import TrainingStopped, fit
from hivetune.train.setup import setup
from hivetune.workflows.train_job import train
from conftest import tiny_config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", ops_records(24))


@pytest.fixture(scope="module")
def parent(tiny_model_dir, data, tmp_path_factory):
    """A run folder trained 3 steps at a high lr: its B is far from zero."""
    out = tmp_path_factory.mktemp("parent") / "run"
    fit(setup(tiny_config(tiny_model_dir, data, out)), progress=False)
    return out


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    from hivetune.ops.attention import Packed

    n = ids.shape[1]
    cu = torch.tensor([0, n], dtype=torch.int32)
    with torch.no_grad():
        hidden = model.eval()(ids, torch.arange(n)[None], Packed(cu, n, (n,)))
        return model.logits(hidden[0])


def adapter_logits(model_dir, adapter, ids) -> torch.Tensor:
    from hivetune.model.load import load_model
    from hivetune.model.lora import fuse_projections, load_adapter

    net = load_model(model_dir)
    load_adapter(net, adapter)
    fuse_projections(net)  # as training joins q/k/v and gate/up
    return logits(net, ids)


IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 8]])


def test_step_0_is_the_parent_adapter_bitwise(parent, tiny_model_dir, data, tmp_path):
    run = setup(tiny_config(tiny_model_dir, data, tmp_path / "child", init_adapter=str(parent)))
    on_disk = load_file(str(parent / "adapter" / "adapter_model.safetensors"))
    ours = lora_state_dict(run.model)
    assert ours.keys() == on_disk.keys() and all(torch.equal(ours[k], on_disk[k]) for k in ours)
    expected = adapter_logits(tiny_model_dir, parent / "adapter", IDS)
    assert torch.equal(logits(run.model, IDS), expected)
    fresh = setup(tiny_config(tiny_model_dir, data, tmp_path / "fresh"))
    assert not torch.equal(logits(fresh.model, IDS), expected)  # the check can fail
    assert run.optimizer.state_dict()["state"] == {} and run.scheduler.last_epoch == 0  # optimizer fresh
    assert run.init_adapter == {"path": str((parent / "adapter").resolve()),
                                "sha256": sha256_file(parent / "adapter" / "adapter_model.safetensors")}


def test_an_adapter_folder_works_and_summary_names_it(parent, tiny_model_dir, data, tmp_path):
    out = tmp_path / "child"
    train(tiny_config(tiny_model_dir, data, out, init_adapter=str(parent / "adapter"), max_steps=1), progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["init_adapter"]["path"] == str((parent / "adapter").resolve())
    assert summary["init_adapter"]["sha256"] == sha256_file(parent / "adapter" / "adapter_model.safetensors")
    assert "init_adapter: " in (out / "config.yaml").read_text()
    trained = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    start = load_file(str(parent / "adapter" / "adapter_model.safetensors"))
    assert any(not torch.equal(trained[k], start[k]) for k in trained)  # one step moved it


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("other-llama")
    build_tokenizer(folder)
    build_tiny_model(folder, seed=1)
    return folder


@pytest.mark.parametrize("change, message", [
    ({"lora": {"r": 8, "alpha": 8, "dropout": 0.0}}, "rank 4, this run's lora.r is 8"),
    ({"lora": {"r": 4, "alpha": 16, "dropout": 0.0}}, "lora_alpha 8, this run's lora.alpha is 16"),
    ({"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}},
     "targets down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj, this run's lora.targets is q_proj,v_proj"),
    ({"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "rslora": True}},
     "use_rslora false, this run's lora.rslora is true"),
])
def test_mismatch_is_one_line_naming_it(change, message, parent, tiny_model_dir, data, tmp_path):
    out = tmp_path / "child"
    with pytest.raises(UserError) as e:
        setup(tiny_config(tiny_model_dir, data, out, init_adapter=str(parent), **change))
    assert str(e.value) == f"--init-adapter {parent}: {message}"
    assert not out.exists()  # nothing left behind


def test_another_base_and_a_missing_folder_are_refused(parent, tiny_model_dir, other_model, data, tmp_path, capsys):
    with pytest.raises(UserError) as e:
        setup(tiny_config(other_model, data, tmp_path / "a", init_adapter=str(parent)))
    assert str(e.value) == f"--init-adapter {parent}: base {tiny_model_dir}, this run's model is {other_model}"
    argv = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(tmp_path / "b"),
            "--device", "cpu", "--init-adapter", str(tmp_path / "nope"), "--quiet"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"hivetune: error: --init-adapter {tmp_path / 'nope'}: not found"


def test_resume_of_a_run_started_from_an_adapter_is_bitwise(parent, tiny_model_dir, data, tmp_path):
    """Cut after step 3, resumed from the step-2 checkpoint: the same weights as the run never cut,
    and the checkpoint holds them, so the parent adapter may be gone by then."""
    import shutil

    shutil.copytree(parent, tmp_path / "parent")
    kw = {"init_adapter": str(tmp_path / "parent"), "max_steps": 6, "save_every": 2, "seed": 7,
          "lora": {"r": 4, "alpha": 8, "dropout": 0.1}}  # dropout draws random numbers: the RNG state matters
    whole = setup(tiny_config(tiny_model_dir, data, tmp_path / "whole", **kw))
    fit(whole, progress=False)
    out = tmp_path / "cut"
    run = setup(tiny_config(tiny_model_dir, data, out, **kw))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=3)
    shutil.rmtree(tmp_path / "parent")
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    a, b = load_file(str(out / "adapter" / "adapter_model.safetensors")), lora_state_dict(whole.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["init_adapter"] == {"path": str((tmp_path / "parent").resolve()), "sha256": None}
