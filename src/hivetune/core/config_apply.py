"""YAML and ``--set`` values applied onto a TrainConfig: types coerced, unknown keys named.

Every problem is appended to a list of error lines instead of raised, so that ``load_config``
reports them all at once. An unknown key gets a did-you-mean (``KEY_ALIASES`` maps the names
people bring from HF Trainer and PEFT to ours; difflib finds typos), and ``data`` given as a
YAML mapping {path, columns, split, config} is folded into its flat keys (``DATA_SECTION``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing

# Names people bring from HF Trainer / PEFT / other tools, mapped to ours for "did you mean".
KEY_ALIASES = {
    "rank": "r", "lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
    "target_modules": "targets", "use_rslora": "rslora", "learning_rate": "lr",
    "num_epochs": "epochs", "num_train_epochs": "epochs", "per_device_train_batch_size": "batch_size",
    "micro_batch_size": "batch_size", "gradient_accumulation_steps": "grad_accum",
    "lr_scheduler_type": "schedule", "lr_scheduler": "schedule", "max_seq_length": "max_length",
    "sequence_len": "max_length", "dataset": "data", "output": "output_dir", "bf16": "precision",
    "fp16": "precision", "model_name_or_path": "model", "base_model": "model",
}


def _coerce(value, typ, key: str, errors: list[str]):
    """Convert a YAML / CLI value to the field's type; record an error instead of raising."""
    origin = typing.get_origin(typ)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, (str, int, float)) for v in value.values()):
            errors.append(f"{key}: expected a mapping of field: column, got {value!r}")
            return None
        return {str(k): str(v) for k, v in value.items()}
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            errors.append(f"{key}: expected a list of names, got {value!r}")
            return None
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        errors.append(f"{key}: expected true or false, got {value!r}")
        return None
    if typ is int:
        if isinstance(value, bool):
            errors.append(f"{key}: expected an integer, got {value!r}")
            return None
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            errors.append(f"{key}: expected an integer, got {value!r}")
            return None
    if typ is float:
        if isinstance(value, bool):
            errors.append(f"{key}: expected a number, got {value!r}")
            return None
        try:
            number = float(value)
        except (TypeError, ValueError):
            errors.append(f"{key}: expected a number, got {value!r}")
            return None
        if not math.isfinite(number):  # nan passes every `<= 0` check; inf epochs crash plan_steps
            errors.append(f"{key}: expected a finite number, got {value!r}")
            return None
        return number
    if typ is str:
        if isinstance(value, bool):  # YAML's true / false for a key that also takes auto
            return "true" if value else "false"
        if isinstance(value, (dict, list)):
            errors.append(f"{key}: expected a string, got {value!r}")
            return None
        return "" if value is None else str(value)
    raise AssertionError(f"unhandled type {typ}")


def _suggest(obj, key: str, prefix: str) -> str:
    """The full name of the key the user probably meant: exact alias, else the closest name or
    alias (difflib), in this section or, from the top level, in a sub-section (lora_alpha)."""
    spots = {}  # spelling -> full key
    for f in dataclasses.fields(obj):
        spots[f.name] = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(getattr(obj, f.name)):
            for sub in dataclasses.fields(getattr(obj, f.name)):
                spots.setdefault(sub.name, f"{prefix}{f.name}.{sub.name}")
    for alias, target in KEY_ALIASES.items():
        if target in spots:
            spots.setdefault(alias, spots[target])
    if key in spots:
        return spots[key]
    close = difflib.get_close_matches(key, list(spots), n=1)
    return spots[close[0]] if close else ""


# `data` as a YAML mapping: its keys -> the flat config keys they stand for.
DATA_SECTION = {"path": "data", "columns": "data_columns", "split": "data_split", "config": "data_config"}


def _fold_data_section(values: dict, errors: list[str]) -> dict:
    """{data: {path, columns, split, config}} -> {data, data_columns, data_split, data_config}."""
    section, values = values["data"], dict(values)
    del values["data"]
    for key, value in section.items():
        if key not in DATA_SECTION:
            errors.append(f"data.{key}: unknown key (expected {', '.join(DATA_SECTION)})")
        else:
            values[DATA_SECTION[key]] = value
    return values


def apply_values(obj, values: dict, prefix: str, errors: list[str]) -> None:
    """Set `values` (a nested mapping of keys) onto the dataclass `obj`, coerced to each field's
    type; each unknown key or bad value becomes one line in `errors`, named `prefix` + key."""
    if not prefix and isinstance(values.get("data"), dict):
        values = _fold_data_section(values, errors)
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in names:
            hint = _suggest(obj, str(key), prefix)
            hint = f" (did you mean {hint}?)" if hint else ""
            errors.append(f"{full}: unknown key{hint}")
            continue
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                errors.append(f"{full}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(typ))}")
                continue
            apply_values(getattr(obj, key), value, f"{full}.", errors)
            continue
        coerced = _coerce(value, typ, full, errors)
        if coerced is not None:
            setattr(obj, key, coerced)

