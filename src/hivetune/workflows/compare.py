"""`hivetune eval --candidate A --against B`: two versions of a model side by side.

A and B are each a run folder, an adapter folder (PEFT), a merged HF folder, a .gguf file (the
weights llama.cpp serves, loaded and dequantised by model.load) or the word ``base`` (the base
model alone: --model, else the base the other side's adapter names, else the embedded model).

Both are scored as ``hivetune eval`` scores (eval_scoring.score_model): token-weighted response loss
and perplexity, greedy answers with exact match, token F1 and ROUGE-L against the reference, on
the held-out set and, with --regression, on a second set. Per example, the side whose answer
has the higher token F1 wins; equal F1 is a tie.

Sides on the same weights share one loaded model: an adapter is merged in for its pass
(eval_scoring.merged_lora), switched off for ``base``, and a second adapter of the same rank and
targets is copied over the first (checkpoint.load_lora_weights) instead of loading the base again.

compare.json (the registry's gate reads it):
  {"candidate": A, "against": B,
   "sets": {"heldout": {"examples": N, "candidate": {loss, perplexity, exact_match, token_f1, rouge_l},
                        "against": {...}, "wins": {"candidate": n, "against": n, "ties": n}},
            "regression": {...}}}    (only with --regression)
compare.md: the same figures as tables, and a few examples where the answers differ.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.core.versions import LLAMA_CPP_INSTALL, llama_cpp_installed
from hivetune.workflows.eval_examples import read_examples
from hivetune.workflows.eval_llama import ENGINES, score_sides_llama
from hivetune.workflows.eval_metrics import mean_metrics
from hivetune.workflows.eval_report import fenced, format_value, table_cell
from hivetune.workflows.eval_scoring import score_model
from hivetune.workflows.evaluate import DEFAULT_MAX_NEW_TOKENS, base_model_path, run_max_new_tokens
from hivetune.workflows.generate import trained_base_quant

ROLES = ("candidate", "against")
METRICS = (("loss", "loss"), ("perplexity", "perplexity"), ("exact_match", "exact_match"), ("token_f1", "f1"),
           ("rouge_l", "rouge_l"))  # compare.json key, mean_metrics key
ACCEPTED = "a run folder, an adapter folder, a merged HF folder, a .gguf file or base"


@dataclass
class Side:
    arg: str  # as given on the command line
    flag: str  # --candidate or --against
    kind: str  # base | adapter | model (a merged HF folder or a .gguf)
    model: Path | None = None  # the weights loaded: the base of base / adapter, the model itself
    adapter: Path | None = None
    quant: str = "none"  # base_quant the adapter trained on (generate.trained_base_quant)

    @property
    def key(self) -> tuple[str, str]:
        """Sides with equal keys run on one loaded model."""
        return str(self.model.resolve()), self.quant


def classify(arg: str, flag: str) -> Side:
    """What A or B names, without reading any weight; a UserError when it is none of ACCEPTED."""
    if arg == "base":
        return Side(arg, flag, "base")
    path = Path(arg)
    for folder in (path / "adapter", path):
        if (folder / "adapter_config.json").is_file():
            return Side(arg, flag, "adapter", adapter=folder)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return Side(arg, flag, "model", model=path)
    if path.is_dir() and (path / "config.json").is_file():
        return Side(arg, flag, "model", model=path)
    if not path.exists():
        raise UserError(f"{flag}: {arg} not found (expected {ACCEPTED})")
    raise UserError(f"{flag}: {arg} is not {ACCEPTED}")


def resolve_sides(candidate: str, against: str, model: str) -> tuple[Side, Side]:
    """Both sides with the weights each loads; refuses adapters of different bases and models of
    different shapes (architecture, vocabulary)."""
    from hivetune.core.hub import model_path

    sides = classify(candidate, "--candidate"), classify(against, "--against")
    for side in sides:
        if side.kind == "adapter":
            side.model = base_model_path(model, side.adapter)
            side.quant = trained_base_quant(side.adapter, side.model)
    named = next((s.model for s in sides if s.kind == "adapter"), None)
    for side in sides:
        if side.kind == "base":
            side.model = model_path(model) if model else named if named is not None else model_path("")
    a, b = sides
    if a.kind == "adapter" and b.kind == "adapter" and a.model.resolve() != b.model.resolve():
        raise UserError(f"--against {b.arg}: an adapter of base {b.model}, the candidate's base is {a.model} "
                        f"(compare adapters of one base, or pass --model)")
    check_same_shape(a, b)
    return a, b


def check_same_shape(a: Side, b: Side) -> None:
    from hivetune.model.load import load_args

    shapes = []
    for side in (a, b):
        if not side.model.exists():
            raise UserError(f"{side.flag} {side.arg}: model {side.model} not found")
        args = load_args(side.model)
        shapes.append({"vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
                       "num_hidden_layers": args.num_hidden_layers})
    for key in shapes[0]:
        if shapes[0][key] != shapes[1][key]:
            raise UserError(f"--against {b.arg}: a model of another base ({key} {shapes[1][key]}, the candidate's "
                            f"is {shapes[0][key]})")


def set_report(examples: int, rows: dict[str, list[dict]]) -> dict:
    """One set of compare.json: the means of both sides and the per-example wins by token F1."""
    wins = {"candidate": 0, "against": 0, "ties": 0}
    for c, a in zip(rows["candidate"], rows["against"]):
        wins["candidate" if c["f1"] > a["f1"] else "against" if a["f1"] > c["f1"] else "ties"] += 1
    means = {role: mean_metrics(rows[role]) for role in ROLES}
    return {"examples": examples, **{role: {key: means[role][m] for key, m in METRICS} for role in ROLES},
            "wins": wins}


def score_sides(sides: tuple[Side, Side], sets: dict[str, Path], max_new_tokens: int, limit: int,
                batch_size: int, max_length: int, device: str, precision: str) -> tuple[dict, dict]:
    """rows[role][set] for both sides, and the examples of each set (as the candidate's tokenizer
    reads them); sides of one key share a loaded model."""
    from hivetune.core.device import DTYPES, resolve_device, resolve_precision
    from hivetune.model.tokenizer import load_tokenizer

    dev = resolve_device(device)
    dtype = DTYPES[resolve_precision(precision, dev)]
    rows: dict[str, dict] = {role: {} for role in ROLES}
    examples: dict[str, dict] = {}
    tokenizers: dict[str, object] = {}
    for key in dict.fromkeys(s.key for s in sides):  # each loaded model once, in order
        group = [(role, s) for role, s in zip(ROLES, sides) if s.key == key]
        tokenizer = tokenizers.setdefault(key[0], load_tokenizer(key[0]))
        examples[key[0]] = {name: read_examples(path, tokenizer, max_length, limit) for name, path in sets.items()}
        net = None
        for role, side in group:
            net = side_model(net, side, group, dtype, dev)
            with active(net, side):
                for name in sets:
                    rows[role][name] = score_model(net, tokenizer, examples[key[0]][name], max_new_tokens,
                                                   batch_size)
    for name in sets:
        if len(rows["candidate"][name]) != len(rows["against"][name]):
            raise UserError(f"{sets[name]}: the two sides' tokenizers read a different number of examples")
    return rows, examples[sides[0].key[0]]


def side_model(net, side: Side, group: list, dtype, dev):
    """The loaded model for `side`: `net` as it is for base, with `side`'s adapter for an adapter
    (its weights copied over a previous adapter's of the same rank and targets, else a new load)."""
    from hivetune.checkpoint import load_lora_weights
    from hivetune.model.load import load_model
    from hivetune.model.lora import fuse_projections, load_adapter, lora_modules, read_adapter_spec

    if net is not None and side.kind == "base":
        return net
    if net is not None and side.kind == "adapter":
        spec = read_adapter_spec(side.adapter)
        modules = lora_modules(net)
        shapes = {(n.rpartition(".")[2], m.lora_A.weight.shape[0]) for n, m in modules}
        if modules and shapes == {(t, spec.r) for t in spec.targets}:
            load_lora_weights(net, side.adapter)
            for _, m in modules:
                m.scaling = spec.scaling
            return net
    net = load_model(side.model, dtype=dtype, device=dev, base_quant=side.quant)
    # the first adapter of the group goes on now, before q/k/v and gate/up are joined (fuse_projections)
    adapter = side.adapter or next((s.adapter for _, s in group if s.adapter is not None), None)
    if adapter is not None:
        load_adapter(net, adapter, param_dtype=dtype)
    if side.quant == "none":
        fuse_projections(net)
    return net.eval()


def active(net, side: Side):
    """The model as `side` scores: its adapter merged in (eval_scoring.merged_lora), else LoRA off."""
    from hivetune.model.lora import lora_enabled
    from hivetune.workflows.eval_scoring import merged_lora

    return merged_lora(net) if side.kind == "adapter" else lora_enabled(net, False)


def compare(candidate: str, against: str, data: str = "", regression: str = "", out: str = "", model: str = "",
            force: bool = False, max_new_tokens: int = 0, limit: int = 0, batch_size: int = 96,
            max_length: int = 1024, device: str = "auto", precision: str = "auto",
            report_examples: int = 3, engine: str = "hivetune") -> dict:
    """`hivetune eval --candidate A --against B`: score both, write compare.json and compare.md
    into `out` (default: A's run folder's compare/); return compare.json's content plus "out"
    and "seconds". Everything is checked before a weight is loaded."""
    from hivetune.core.embedded import default_heldout_data
    from hivetune.core.fileio import atomic_write_bytes
    from hivetune.data.sources import held_out_source, source_exists

    for name, value, low in (("max_new_tokens", max_new_tokens, 0), ("limit", limit, 0),
                             ("batch_size", batch_size, 1), ("max_length", max_length, 2)):
        if value < low:
            raise UserError(f"--{name.replace('_', '-')}: must be >= {low}, got {value}")
    if not candidate or not against:
        raise UserError("eval: --candidate and --against go together (each " + ACCEPTED + ")")
    if engine not in ENGINES:
        raise UserError(f"--engine: {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "llama.cpp" and not llama_cpp_installed():
        raise UserError(f"--engine llama.cpp: {LLAMA_CPP_INSTALL}")
    t_start = time.perf_counter()
    sides = resolve_sides(candidate, against, model)
    sets = {"heldout": held_out_source(data) if data else default_heldout_data()}
    if regression:
        sets["regression"] = held_out_source(regression)
    for name, path in sets.items():
        if not source_exists(path):
            raise UserError(f"--{'data' if name == 'heldout' else 'regression'}: {path} not found")
    out_dir = compare_out_dir(out, sides[0])
    existing = [p.name for p in (out_dir / "compare.json", out_dir / "compare.md") if p.exists()]
    if existing and not force:
        raise UserError(f"--out: {out_dir} already holds {' and '.join(existing)}; pass --force to overwrite")
    if not max_new_tokens:
        max_new_tokens = run_max_new_tokens(sides[0].adapter) if sides[0].adapter else DEFAULT_MAX_NEW_TOKENS
    if engine == "llama.cpp":
        rows, examples = score_sides_llama(sides, sets, max_new_tokens, limit, max_length)
    else:
        rows, examples = score_sides(sides, sets, max_new_tokens, limit, batch_size, max_length, device, precision)
    report = {"candidate": candidate, "against": against, "engine": engine,
              "sets": {name: set_report(len(examples[name]), {role: rows[role][name] for role in ROLES}) for name in sets}}
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "compare.json", (json.dumps(report, indent=2) + "\n").encode())
    md = markdown_report(report, sides, sets, rows, examples, max_new_tokens, report_examples)
    atomic_write_bytes(out_dir / "compare.md", md.encode())
    return {**report, "out": str(out_dir), "seconds": round(time.perf_counter() - t_start, 2)}


def compare_out_dir(out: str, candidate: Side) -> Path:
    """--out, else the candidate's run folder's (or adapter folder's) compare/."""
    if out:
        path = Path(out)
    elif candidate.adapter is not None:
        path = (candidate.adapter.parent if candidate.adapter.name == "adapter" else candidate.adapter) / "compare"
    else:
        raise UserError(f"--out: name a folder for compare.json ({candidate.arg} is not a run or adapter folder)")
    if path.exists() and not path.is_dir():
        raise UserError(f"--out: {path} is a file, expected a folder")
    return path


# ---------------------------------------------------------------- compare.md


def means_table(entry: dict) -> str:
    """One set's means as a Markdown table: metric | candidate | against | change, and the wins."""
    kinds = {"loss": "num", "perplexity": "num"}
    lines = ["| metric | candidate | against | change |", "|---|---:|---:|---:|"]
    for key, _ in METRICS:
        kind = kinds.get(key, "pct")
        c, a = entry["candidate"][key], entry["against"][key]
        change = "n/a" if c is None or a is None else (
            f"{100 * (c - a):+.1f} pts" if kind == "pct" else f"{c - a:+.4f}")
        lines.append(f"| {key.replace('_', ' ')} | {format_value(c, kind)} | {format_value(a, kind)} | {change} |")
    w = entry["wins"]
    lines.append(f"| wins (token F1) | {w['candidate']} | {w['against']} | {w['ties']} ties |")
    return "\n".join(lines)


def markdown_report(report: dict, sides, sets: dict, rows: dict, examples: dict, max_new_tokens: int,
                    n_examples: int) -> str:
    described = {"base": "the base model alone", "adapter": "adapter {adapter} on {model}", "model": "model {model}"}
    parts = ["# hivetune eval: candidate vs against", ""]
    for role, side in zip(ROLES, sides):
        what = described[side.kind].format(adapter=side.adapter, model=side.model)
        parts.append(f"- {role}: `{side.arg}` ({what})")
    parts += [f"- greedy answers of at most {max_new_tokens} new tokens; a win is a higher token F1 against the "
              f"reference", ""]
    for name, entry in report["sets"].items():
        parts += [f"## {name}: `{sets[name]}`, {entry['examples']} examples", "", means_table(entry), ""]
        differing = [i for i, (c, a) in enumerate(zip(rows["candidate"][name], rows["against"][name]))
                     if c["generation"] != a["generation"]][:n_examples]
        for i in differing:
            c, a, e = rows["candidate"][name][i], rows["against"][name][i], examples[name][i]
            parts += [f"### {e.where}", "", "**Question**", "", fenced(e.question), "", "**Reference**", "",
                      fenced(e.reference), "", "| | candidate | against |", "|---|---|---|",
                      f"| answer | {table_cell(c['generation'])} | {table_cell(a['generation'])} |",
                      f"| token F1 | {format_value(c['f1'], 'pct')} | {format_value(a['f1'], 'pct')} |", ""]
    return "\n".join(parts) + "\n"
