"""Start-up: what importing hivetune loads. A training run's modules and the CLI load no heavy
library they do not use at import (each is imported where it is used), and `hivetune --help`
imports no torch at all. Each check runs in a fresh interpreter (benchmarks/startup.py times
the same imports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
TRAIN_MODULES = ("hivetune.train.run", "hivetune.train.setup", "hivetune.train.step", "hivetune.train.loop",
                 "hivetune.workflows.train_job", "hivetune.cli")
# Loaded only by the runs that use them: FSDP and torch.compile (torch._dynamo and _inductor
# register ~200 torch.library ops on import), the tokenizer (transformers' auto classes, which
# bring scikit-learn and torch.distributed.tensor), Hub / parquet data, plots, trackers, and
# Triton (the fused kernels are built at their first call).
HEAVY = ("torch._dynamo", "torch._inductor", "torch.distributed.fsdp", "torch.distributed.tensor",
         "transformers", "sklearn", "datasets", "pyarrow", "pandas", "matplotlib", "tensorboard", "mlflow",
         "wandb", "triton", "huggingface_hub", "jinja2", "sympy", "safetensors", "gguf", "yaml")


def loaded_after(code: str) -> list[str]:
    """The modules of sys.modules (top-level names and the HEAVY submodules) after `code` runs in
    a fresh interpreter with this checkout's src first on the path."""
    probe = (f"import sys, json\nsys.path.insert(0, {str(SRC)!r})\n{code}\n"
             "names = set(sys.modules)\n"
             "sys.__stdout__.write('\\nLOADED ' + json.dumps(sorted(names)) + '\\n')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith("LOADED "))
    return json.loads(line[len("LOADED "):])


def heavy_in(names: list[str], allowed: tuple[str, ...] = ()) -> list[str]:
    found = set(names)
    return [h for h in HEAVY if h in found and h not in allowed]


def test_train_modules_load_no_heavy_library():
    names = loaded_after("\n".join(f"import {m}" for m in TRAIN_MODULES))
    assert "torch" in names  # the check sees what was imported
    # yaml: the config is YAML (core.config reads it at import for the recipe defaults)
    assert heavy_in(names, allowed=("yaml",)) == []


def test_help_imports_no_torch():
    names = loaded_after("import runpy\nsys.argv = ['hivetune', '--help']\n"
                         "try:\n    runpy.run_module('hivetune', run_name='__main__')\nexcept SystemExit:\n    pass")
    assert "hivetune.cli" in names
    assert [n for n in names if n == "torch" or n.startswith("torch.")] == []
    assert heavy_in(names) == []


def test_train_help_imports_no_torch():
    names = loaded_after("from hivetune.cli import main\n"
                         "try:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass")
    assert [n for n in names if n == "torch" or n.startswith("torch.")] == []


@pytest.mark.parametrize("extra", [[], ["--set", "gradient_checkpointing=true"]])
def test_train_run_on_cpu_loads_no_compiler_nor_transformers(extra, tiny_model_dir, alpaca_file, tmp_path):
    """A whole `hivetune train` on an HF folder (a generic tokenizer class) on the CPU: the
    tokenizer comes without transformers, the model is built on the meta device without maths
    that runs through torch._refs, the optimizer step without torch's _use_grad wrapper, and
    checkpointed layers without torch.utils.checkpoint (it reads torch._dynamo's config); each
    of those imports torch._dynamo (and with it sympy), seconds of start-up."""
    names = loaded_after("from hivetune.cli import main\n"
                         f"main(['train', '--model', {str(tiny_model_dir)!r}, '--data', {str(alpaca_file)!r}, "
                         f"'--max-steps', '2', '--quiet', '--output', {str(tmp_path / 'run')!r}, *{extra!r}])")
    assert (tmp_path / "run" / "adapter").is_dir()  # the run went through
    assert heavy_in(names, allowed=("yaml", "jinja2", "safetensors")) == []
