"""--model ORG/NAME[@REVISION]: resolved from a local cache in the Hub's layout, offline; every
failure one line, exit 2."""

from __future__ import annotations

import json

import pytest

from conftest import hub_cache_repo
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.core.hub import base_model_name, model_path, split_hub_id

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def cached_model(hub_cache, tiny_model_dir):
    return hub_cache_repo(hub_cache, REPO, tiny_model_dir)


def test_hub_id_shapes():
    assert split_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert split_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    assert split_hub_id("model.gguf") is None
    assert split_hub_id("/abs/path") is None
    assert split_hub_id("a/b/c") is None


def test_a_cached_hub_id_resolves_offline(cached_model):
    assert model_path(REPO) == cached_model
    assert model_path(f"{REPO}@{cached_model.name}") == cached_model  # a commit as the revision
    assert (model_path(REPO) / "config.json").is_file()


def test_a_local_path_wins_over_the_hub(cached_model, tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, tmp_path / REPO)
    assert model_path(REPO).resolve() == (tmp_path / REPO).resolve()


def test_not_cached_offline_is_one_line_exit_2(hub_cache, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--model", "tiny-org/missing", "--output", str(out), "--device", "cpu"])
    assert code == 2
    assert capsys.readouterr().err == (
        "hivetune: error: tiny-org/missing: not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
        "download it once online (hf download tiny-org/missing) or pass a local path\n")
    assert not out.exists()


@pytest.mark.parametrize("error, expected", [
    ("GatedRepoError", "tiny-org/gated: gated model on the Hugging Face Hub; accept its terms at "
                       "https://huggingface.co/tiny-org/gated and log in (hf auth login or HF_TOKEN)"),
    ("RepositoryNotFoundError", "tiny-org/gated: no such model on the Hugging Face Hub (a typo, or private: log "
                                "in with hf auth login); a local path is used when it exists"),
    ("RevisionNotFoundError", "tiny-org/gated@nope: no revision 'nope' of tiny-org/gated on the Hugging Face Hub"),
])
def test_gated_typo_and_revision_are_named(error, expected, hub_cache, monkeypatch):
    from types import SimpleNamespace

    import huggingface_hub
    from huggingface_hub import errors

    def refuse(*args, **kwargs):  # what the Hub answers, without a network
        raise getattr(errors, error)("refused", response=SimpleNamespace(headers={}, request=None))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(UserError) as info:
        model_path("tiny-org/gated@nope" if error == "RevisionNotFoundError" else "tiny-org/gated")
    assert str(info.value) == expected


def test_adapter_names_the_hub_id(cached_model, tmp_path, capsys):
    from conftest import ops_records, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", ops_records(8))
    out = tmp_path / "run"
    assert main(["train", "--model", REPO, "--data", str(data), "--output", str(out), "--max-steps", "1",
                 "--batch-size", "4", "--precision", "fp32", "--device", "cpu", "--quiet",
                 "--set", "eval_prompts=0"]) == 0
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == REPO
    assert base_model_name("some/dir", cached_model) == "some/dir"
    capsys.readouterr()
    assert main(["generate", "--adapter", str(out), "--model", REPO, "--max-new-tokens", "2",
                 "--precision", "fp32", "--device", "cpu", "--no-chat", "hello"]) == 0
    assert main(["plan", "--model", REPO, "--data", str(data), "--memory", "8"]) == 0
    assert main(["data", "stats", str(data), "--model", REPO]) == 0
    assert main(["export", str(out), "--format", "merged", "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()
    assert main(["eval", "--adapter", str(out), "--data", str(data), "--limit", "1", "--max-new-tokens", "2",
                 "--precision", "fp32", "--device", "cpu"]) == 0  # the base from the adapter's Hub id
    assert json.loads((out / "eval" / "eval.json").read_text())["model"] == str(cached_model)


def test_chat_takes_a_hub_id(cached_model, monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", REPO, "--max-new-tokens", "2", "--precision", "fp32", "--device", "cpu"]) == 0


def test_tune_and_bench_take_a_hub_id(cached_model, tmp_path, monkeypatch, capsys):
    from conftest import ops_records, write_jsonl

    monkeypatch.chdir(tmp_path)
    assert main(["tune", "--model", REPO, "--device", "cpu", "--precision", "fp32", "--batch-size", "2",
                 "--batch-sizes", "1,2", "--steps", "2", "--length", "16", "--out", "tune.yaml"]) == 0
    data = write_jsonl(tmp_path / "train.jsonl", ops_records(8))
    assert main(["bench", "--model", REPO, "--data", str(data), "--max-steps", "1", "--json", "bench.json",
                 "--set", "device=cpu", "--set", "precision=fp32", "--set", "batch_size=4"]) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["model"] == REPO
