"""Typed training config: YAML file + ``key=value`` overrides, validated once, all errors at once.

Nothing here touches weights or data: ``load_config`` runs before any model is opened, so a
typo costs milliseconds, not a model load.

This module reads and writes the config: the YAML file, the ``--set`` overrides, their merge,
and a run folder's saved config.yaml. The parts live beside it: ``config_schema`` (TrainConfig,
its fields and their documentation), ``config_apply`` (values coerced onto the fields, unknown
keys with a did-you-mean) and ``config_validate`` (the checks of the values).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from hivetune.core.config_apply import apply_values
from hivetune.core.config_schema import TrainConfig
from hivetune.core.config_validate import validate
from hivetune.core.errors import UserError

__all__ = ["DEFAULT_RECIPE", "TrainConfig", "load_config", "load_run_config", "merge", "parse_overrides",
           "read_yaml", "save_config", "step_order", "to_dict"]


def parse_overrides(pairs: list[str]) -> dict:
    """["lora.r=8", "lr=1e-4"] -> {"lora": {"r": 8}, "lr": 1e-4} (values parsed as YAML scalars)."""
    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise UserError(f"override {pair!r}: expected key=value")
        key, _, raw = pair.partition("=")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        except RecursionError:
            raise UserError(f"override {key.strip()}: value nested too deeply") from None
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {pair!r}: {part} is not a section")
        node[parts[-1]] = value
    return out


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if k == "data" and k in out and isinstance(v, dict) != isinstance(out[k], dict):
            # a path (--data FILE) meets the data section (--set data.columns.output=x): it is the path
            v = v if isinstance(v, dict) else {"path": v}
            out[k] = out[k] if isinstance(out[k], dict) else {"path": out[k]}
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def adapter_run_config(adapter: Path) -> Path | None:
    """The config.yaml of the run that wrote `adapter` (RUN/config.yaml beside RUN/adapter), or
    None for an adapter folder alone."""
    config = Path(adapter).parent / "config.yaml"
    return config if Path(adapter).name == "adapter" and config.is_file() else None


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: unreadable config ({e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    except RecursionError:
        raise UserError(f"{path}: invalid YAML (nested too deeply)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config keys at the top level")
    return data


DEFAULT_RECIPE = Path(__file__).parents[1] / "recipes" / "default.yaml"


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> TrainConfig:
    """YAML (optional) + overrides -> a validated TrainConfig; every problem in one UserError.

    With no file and neither model nor data given, the embedded default recipe is the base.
    """
    overrides = overrides or {}
    if path is None and not overrides.get("model") and not overrides.get("data"):
        path = DEFAULT_RECIPE
    values = read_yaml(path) if path else {}
    values = merge(values, overrides)
    cfg = TrainConfig()
    errors: list[str] = []
    apply_values(cfg, values, "", errors)
    errors += validate(cfg)
    if errors:
        raise UserError("invalid config:\n  " + "\n  ".join(errors) if len(errors) > 1 else errors[0])
    return cfg


def step_order(cfg: TrainConfig) -> str:
    """The step plan's order (data.step_plan.plan_steps) for batch_order: auto is balanced with
    packing, random without."""
    if cfg.batch_order != "auto":
        return cfg.batch_order
    return "balanced" if cfg.packing else "random"


def load_run_config(path: str | Path, overrides: dict | None = None) -> TrainConfig:
    """A run folder's config.yaml (load_config), keys it lacks given the value its run had: a
    config written before batch_order existed ran in random order."""
    values = read_yaml(path)
    if isinstance(values, dict) and "batch_order" not in values:
        overrides = {"batch_order": "random", **(overrides or {})}
    return load_config(path, overrides)


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: Path) -> None:
    from hivetune.core.fileio import atomic_write_bytes

    atomic_write_bytes(path, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
