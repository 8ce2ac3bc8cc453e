"""Config: YAML + overrides, coercion, every error at once, did-you-mean, the default recipe, --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hivetune.cli import build_parser, main, train_overrides
from hivetune.core.config import DEFAULT_RECIPE, TrainConfig, load_config, parse_overrides, read_yaml
from hivetune.core.config_apply import KEY_ALIASES
from hivetune.core.errors import UserError

DATA = {"data": "train.jsonl"}  # any value: load_config does not open the data


def error_of(path=None, overrides=None) -> str:
    with pytest.raises(UserError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_all_errors_reported_together():
    message = error_of(None, {**DATA, "lr": -1, "batch_size": 0, "learnign_rate": 1e-4, "precision": "fp8",
                              "lora": {"r": 0, "dropout": 1.0, "lora_alpha": 8}, "schedule": "step"})
    assert message == (
        "invalid config:\n"
        "  learnign_rate: unknown key (did you mean lr?)\n"
        "  lora.lora_alpha: unknown key (did you mean lora.alpha?)\n"
        "  precision: 'fp8' is not one of auto, bf16, fp16, fp32\n"
        "  schedule: 'step' is not one of cosine, linear, constant\n"
        "  batch_size: must be > 0, got 0\n"
        "  lora.r: must be > 0, got 0\n"
        "  lr: must be > 0, got -1.0\n"
        "  lora.dropout: must be in [0, 1), got 1.0"
    )


def test_one_error_is_one_line():
    assert error_of(None, {**DATA, "grad_accum": -2}) == "grad_accum: must be > 0, got -2"
    assert error_of(None, {**DATA, "batch_order": "sorted"}) == "batch_order: 'sorted' is not one of auto, random, balanced"
    assert error_of(None, {**DATA, "device": "cpu", "precision": "fp16"}) == \
        "precision: fp16 needs a GPU; use bf16 or fp32 with device cpu"


@pytest.mark.parametrize("key,hint", [
    ("learning_rat", "lr"),  # difflib over names and aliases
    ("learning_rate", "lr"),  # KEY_ALIASES
    ("epoch", "epochs"),
    ("batchsize", "batch_size"),
    ("gradient_accumulation_steps", "grad_accum"),
    ("lora_alpha", "lora.alpha"),  # alias of a lora key given at the top level
    ("rank", "lora.r"),
    ("output", "output_dir"),
    ("lora.lora_alpha", "lora.alpha"),
    ("lora.rank", "lora.r"),
    ("lora.target_modules", "lora.targets"),
    ("lora.dropuot", "lora.dropout"),
])
def test_unknown_key_did_you_mean(key, hint):
    assert error_of(None, {**DATA, **parse_overrides([f"{key}=1"])}) == f"{key}: unknown key (did you mean {hint}?)"


def test_unknown_key_without_a_close_match():
    assert error_of(None, {**DATA, "zzzz": 1}) == "zzzz: unknown key"


def test_every_alias_points_at_a_real_key():
    top = set(TrainConfig.__dataclass_fields__)
    lora = set(TrainConfig().lora.__dataclass_fields__)
    assert all(target in top | lora for target in KEY_ALIASES.values())
    assert not set(KEY_ALIASES) & (top | lora)


def test_overrides_parse_to_typed_values():
    overrides = parse_overrides(["lora.targets=q_proj, v_proj", "lora.r=8", "lr=1e-4", "packing=false",
                                 "train_on_inputs=true", "epochs=2", "model=m", "data=d"])
    assert overrides["lora"] == {"targets": "q_proj, v_proj", "r": 8}
    cfg = load_config(None, overrides)
    assert cfg.lora.targets == ["q_proj", "v_proj"]
    assert cfg.lora.r == 8 and isinstance(cfg.lora.r, int)
    assert cfg.lr == 1e-4 and isinstance(cfg.lr, float)
    assert cfg.epochs == 2.0 and isinstance(cfg.epochs, float)
    assert cfg.packing is False and cfg.train_on_inputs is True


@pytest.mark.parametrize("text,value", [("true", True), ("False", False), ("yes", True), ("off", False),
                                        ("1", True), ("0", False)])
def test_bool_strings(text, value):
    assert load_config(None, {**DATA, "gradient_checkpointing": text}).gradient_checkpointing is value


@pytest.mark.parametrize("overrides,message", [
    ({"max_steps": 1.5}, "max_steps: expected an integer, got 1.5"),
    ({"batch_size": True}, "batch_size: expected an integer, got True"),
    ({"seed": "seven"}, "seed: expected an integer, got 'seven'"),
    ({"lr": True}, "lr: expected a number, got True"),
    ({"lr": "fast"}, "lr: expected a number, got 'fast'"),
    ({"lr": "nan"}, "lr: expected a finite number, got 'nan'"),
    ({"epochs": float("inf")}, "epochs: expected a finite number, got inf"),
    ({"lora": {"alpha": float("nan")}}, "lora.alpha: expected a finite number, got nan"),
    ({"packing": "maybe"}, "packing: expected true or false, got 'maybe'"),
    ({"packing": 2}, "packing: expected true or false, got 2"),
    ({"lora": {"targets": [1, 2]}}, "lora.targets: expected a list of names, got [1, 2]"),
    ({"lora": {"targets": ""}}, "lora.targets: must name at least one module"),
    ({"model": ["a"]}, "model: expected a string, got ['a']"),
    ({"lora": 8}, "lora: expected a mapping of r, alpha, dropout, targets, rslora"),
])
def test_bad_values(overrides, message):
    assert error_of(None, {**DATA, **overrides}) == message


def test_integral_float_is_an_int():
    cfg = load_config(None, {**DATA, "max_steps": 10.0, "batch_size": "4"})
    assert cfg.max_steps == 10 and isinstance(cfg.max_steps, int)
    assert cfg.batch_size == 4


def test_override_syntax_errors():
    with pytest.raises(UserError) as e:
        parse_overrides(["lr"])
    assert str(e.value) == "override 'lr': expected key=value"
    with pytest.raises(UserError) as e:
        parse_overrides(["lora=8", "lora.r=4"])
    assert str(e.value) == "override 'lora.r=4': lora is not a section"


def test_yaml_file_then_overrides_win(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: m\ndata: d\nlr: 5.0e-4\nbatch_size: 2\nlora:\n  r: 4\n  alpha: 16\n")
    cfg = load_config(path, {"lr": 1e-5, "lora": {"r": 32}})
    assert cfg.lr == 1e-5  # override wins
    assert cfg.batch_size == 2  # file beats the default
    assert cfg.lora.r == 32 and cfg.lora.alpha == 16.0  # sections merge key by key
    assert cfg.grad_accum == 1  # default
    # the CLI: shortcut flags override the file, --set overrides the flags
    ns = build_parser().parse_args(["train", "--config", str(path), "--lr", "1e-3", "--lora-r", "8",
                                    "--set", "lora.r=2", "--no-packing"])
    cfg = load_config(ns.config, train_overrides(ns))
    assert (cfg.lr, cfg.lora.r, cfg.lora.alpha, cfg.packing) == (1e-3, 2, 16.0, False)


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: 1e-4\nlora:\n  r: 8\n   alpha: 16\n")
    assert error_of(bad) == f"{bad}:4: invalid YAML (mapping values are not allowed here)"
    top_list = tmp_path / "list.yaml"
    top_list.write_text("- lr: 1\n- r: 2\n")
    assert error_of(top_list) == f"{top_list}: expected a mapping of config keys at the top level"
    assert error_of(tmp_path / "none.yaml") == f"{tmp_path / 'none.yaml'}: config file not found"
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert read_yaml(empty) == {}
    typo = tmp_path / "typo.yaml"
    typo.write_text("data: d\nlearning_rate: 1.0e-4\nbatch_size: 0\n")
    assert error_of(typo) == ("invalid config:\n  learning_rate: unknown key (did you mean lr?)\n"
                              "  batch_size: must be > 0, got 0")


def test_default_recipe_only_without_model_and_data():
    recipe = read_yaml(DEFAULT_RECIPE)
    assert recipe["lr"] == 5e-3 and recipe["max_length"] == 512 and recipe["lr"] != TrainConfig.lr
    cfg = load_config(None, {})
    assert (cfg.lr, cfg.max_length, cfg.model, cfg.data) == (5e-3, 512, "", "")
    assert (cfg.epochs, cfg.batch_size, cfg.max_new_tokens) == (1.0, 8, 64)
    assert load_config(None, {"output_dir": "x", "lr": 3e-3}).lr == 3e-3  # overrides still win
    assert load_config(None, {"output_dir": "x"}).max_length == 512
    for given in ({"data": "d.jsonl"}, {"model": "m.gguf"}):
        cfg = load_config(None, given)
        assert (cfg.lr, cfg.max_length) == (2e-4, 1024) == (TrainConfig.lr, TrainConfig.max_length)
    ns = build_parser().parse_args(["train", "--data", "d.jsonl"])
    assert load_config(ns.config, train_overrides(ns)).lr == 2e-4


def test_python_m_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "hivetune", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: hivetune ")
    for command in ("train", "generate"):
        assert f"    {command} " in out.stdout


def test_train_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--config", "--set KEY=VALUE", "--model PATH", "--data FILE", "--lr", "--lora-r",
                 "--lora-targets NAMES", "--gradient-checkpointing", "--no-packing", "--train-on-inputs"):
        assert flag in text, flag


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: hivetune" in capsys.readouterr().out
