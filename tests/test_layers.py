"""The package's house rules: layered imports without cycles, files of at most 600 lines, and only
the environment switches that users need.

Layers: each module imports only its own layer or lower ones.

Every ``import`` and ``from ... import`` statement of every module is read from its source
(function-local ones included), so a lazy import cannot hide an upward dependency.

    layer  packages
      8    cli, __main__
      7    workflows
      6    train
      5    parallel
      4    plan, checkpoint, doctor
      3    data
      2    model
      1    ops
      0    core, the package's face (hivetune/__init__.py)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import hivetune

PACKAGE = Path(hivetune.__file__).parent
LAYERS = {
    "core": 0, "ops": 1, "model": 2, "data": 3, "plan": 4, "checkpoint": 4, "doctor": 4,
    "parallel": 5, "train": 6, "workflows": 7, "cli": 8, "__main__": 8,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """The layer of a module of the package: its first name under ``hivetune``; None for the face."""
    parts = module.split(".")
    if parts[0] != "hivetune":
        return None
    if len(parts) == 1:
        return 0
    if parts[1] not in LAYERS:
        raise AssertionError(f"{module}: not in any layer; add its package to tests/test_layers.py's LAYERS")
    return LAYERS[parts[1]]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every hivetune module the file imports, wherever the import stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "hivetune"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "hivetune":
                continue
            for a in node.names:  # `from hivetune.ops import attention` names a module
                sub = f"{base}.{a.name}"
                is_module = (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() or \
                    (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists()
                found.append((node.lineno, sub if is_module else base))
    return list(dict.fromkeys(found))


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_imports_only_its_layer_or_below():
    upward = []
    for name, path in modules().items():
        own = layer_of(name)
        for line, target in imported_modules(path):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name} (layer {own}) imports "
                              f"{target} (layer {theirs})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_cycles():
    mods = modules()
    graph = {name: sorted({t for _, t in imported_modules(p) if t in mods and t != name}) for name, p in mods.items()}
    # A package's __init__ importing its own submodules is how a package shows its face, not a cycle.
    for name in graph:
        graph[name] = [t for t in graph[name] if not (mods[name].name == "__init__.py" and t.startswith(name + "."))]
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, expected", [
    ("from hivetune.train.loop import fit\n", [(1, "hivetune.train.loop")]),
    ("def f():\n    from hivetune.ops import attention\n", [(2, "hivetune.ops.attention")]),
    ("import hivetune.model.decoder as d\n", [(1, "hivetune.model.decoder")]),
    ("from .decoder import CausalLM\n", [(1, "hivetune.model.decoder")]),
])
def test_imports_are_read_everywhere(tmp_path, monkeypatch, source, expected):
    """The reader finds lazy, aliased and relative imports (a file placed as hivetune/model/x.py)."""
    fake = tmp_path / "hivetune"
    (fake / "model").mkdir(parents=True)
    (fake / "ops").mkdir()
    for f in ("__init__.py", "model/__init__.py", "model/decoder.py", "ops/__init__.py", "ops/attention.py"):
        (fake / f).write_text("")
    (fake / "model" / "x.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert imported_modules(fake / "model" / "x.py") == expected


MAX_LINES = 600
# The only environment names the package reads: its cache folder, the reference switch (docs/fast-paths.md),
# the bytecode cache's switch (read before any config or torch: core.bytecode), the tests' slow-checkpoint hook,
# and serve's shared key (an environment variable so that the key stays out of shell history and `ps`;
# docs/serve.md).
ENVIRONMENT = {"HIVETUNE_CACHE", "HIVETUNE_REFERENCE", "HIVETUNE_BYTECODE_CACHE", "HIVETUNE_TEST_SLOW_CHECKPOINT",
               "HIVETUNE_API_KEY"}


def test_no_source_file_over_600_lines():
    long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)


def test_only_the_user_environment_switches():
    names = {m for p in PACKAGE.rglob("*.py") for m in re.findall(r"HIVETUNE_[A-Z_]+", p.read_text())}
    assert names <= ENVIRONMENT, f"environment names beyond {sorted(ENVIRONMENT)}: {sorted(names - ENVIRONMENT)}"
