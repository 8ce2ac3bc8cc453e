"""docs/config.md's config reference is the text generated from TrainConfig's field docstrings."""

from pathlib import Path

from hivetune.core.config_schema import TrainConfig
from hivetune.workflows import config_reference

CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_doc_holds_the_generated_config_reference():
    text = CONFIG_DOC.read_text()
    assert config_reference.replace_section(text) == text, (
        "docs/config.md is stale: python -m hivetune.workflows.config_reference --write docs/config.md")


def test_every_key_is_listed_once_with_its_default():
    lines = config_reference.config_reference_markdown().splitlines()
    keys = [line.split("`")[1] for line in lines]
    assert len(keys) == len(set(keys))
    assert "lora.r" in keys and "batch_size" in keys and len(keys) == len(TrainConfig.__dataclass_fields__) + 4 + 4  # lora.*, preference.*: 5 keys each
    assert "- `batch_size` = `8`: Examples per micro-batch." in lines
