"""`hivetune export`: a trained run as a PEFT adapter, a merged HF folder, or GGUF for llama.cpp.

Every format is written into a temp sibling folder (``.<name>.tmp-<pid>``) and renamed into
place at the end, after a free-space check against the estimated size, so an interrupted or
failed export never leaves half a folder under the final name.

- adapter: the run's adapter_config.json + adapter_model.safetensors and a model card.
- merged:  config.json, safetensors (sharded with an index above ``shard_bytes``), tokenizer
           files, generation_config.json; each targeted weight is W + scale * B A (fp32 math).
- gguf:    model-<type>.gguf (merged), lora-adapter.gguf (for ``llama-server --lora``), an
           Ollama Modelfile and llama-server.sh, and a README with the commands. f32 / f16 / bf16 /
           q8_0 are written by hivetune; the K-quants and q4_0 by llama.cpp's own quantizer
           (llama-cpp-python's llama_model_quantize) from the f16 file hivetune writes first,
           with ``imatrix`` weighing each tensor's rounding by its inputs' mean squares on
           calibration text (model.imatrix).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hivetune.core.errors import UserError
from hivetune.core.fileio import replace_folder
from hivetune.model.gguf_quantize import LLAMA_CPP_QUANTS, MAX_BITS_PER_WEIGHT, require_llama_cpp

FORMATS = ("adapter", "merged", "gguf")
DTYPES = ("f32", "f16", "bf16", "q8_0")
FORMAT_DTYPES = {"adapter": (), "merged": ("f32", "f16", "bf16"), "gguf": ("f32", "f16", "bf16", "q8_0")}
DEFAULT_DTYPE = {"merged": "f32", "gguf": "f16"}
QUANTS = (*LLAMA_CPP_QUANTS, *FORMAT_DTYPES["gguf"])  # --quant: llama.cpp's types, then hivetune's
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BYTES = {"f32": 4, "f16": 2, "bf16": 2}
SHARD_BYTES = 5 * 10**9  # transformers' usual max_shard_size
MARGIN_BYTES = 64 * 2**20  # tokenizer files, metadata, model card


@dataclass
class ExportResult:
    out: Path
    format: str
    dtype: str | None
    files: list[str] = field(default_factory=list)
    commands: str = ""  # how to run it (gguf: llama-server / Ollama), also in out/README.md


def export(run: str | Path, format: str, out: str | Path, dtype: str | None = None, force: bool = False,
           model: str = "", shard_bytes: int = SHARD_BYTES, quant: str | None = None,
           imatrix: str = "") -> ExportResult:
    """Export the run (or adapter folder) `run` as `format` into the new folder `out`; `quant`
    (gguf only) names the GGUF type like `dtype` does and adds the llama.cpp-made types;
    `imatrix` ("train": the run's training data, or a data source) calibrates those."""
    from hivetune.model.load import load_args

    if format not in FORMATS:
        raise UserError(f"--format: unknown format {format!r} (adapter, merged, gguf)")
    dtype = check_quant(format, dtype, quant) if quant else check_dtype(format, dtype)
    adapter = finished_adapter(Path(run))
    calibration = calibration_source(imatrix, dtype, adapter) if imatrix else None
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out}: already exists; pass --force to replace it")
    base = base_model_path(adapter, model)
    args = load_args(base)
    if format == "gguf":
        from hivetune.model.gguf_write import gguf_arch

        gguf_arch(args, str(base))
    check_free_space(out, estimate_bytes(format, dtype, args, adapter))

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if format == "adapter":
            result = write_adapter(tmp, adapter, base)
        else:
            net, tokenizer = load_merged_source(base, adapter)
            if format == "merged":
                result = write_merged(tmp, net, tokenizer, dtype, base, adapter, shard_bytes)
            else:
                importance = measure_importance(net, tokenizer, *calibration) if calibration else None
                result = write_gguf(tmp, net, tokenizer, dtype, base, adapter, out, importance)
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.out = out
    return result


# ------------------------------------------------------------------------------ checks


def check_dtype(format: str, dtype: str | None) -> str | None:
    if dtype is None or dtype == "":
        return DEFAULT_DTYPE.get(format)
    if format == "gguf" and dtype in LLAMA_CPP_QUANTS:
        raise UserError(f"--dtype: {dtype} is made by llama.cpp's quantizer: pass --quant {dtype}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype: unknown dtype {dtype!r} (f32, f16, bf16, q8_0)")
    if format == "adapter":
        raise UserError("--dtype: not used with --format adapter (the adapter is copied as trained)")
    if dtype not in FORMAT_DTYPES[format]:
        raise UserError(f"--dtype: {dtype} is not available for --format {format} "
                        f"({', '.join(FORMAT_DTYPES[format])})")
    return dtype


def check_quant(format: str, dtype: str | None, quant: str) -> str:
    """The GGUF type named by --quant; the llama.cpp-made ones need llama-cpp-python importable."""
    if format != "gguf":
        raise UserError(f"--quant: only for --format gguf (--format {format} takes --dtype)")
    if quant not in QUANTS:
        raise UserError(f"--quant: unknown type {quant!r} ({', '.join(QUANTS)})")
    if dtype and dtype != quant:
        raise UserError(f"--dtype {dtype} and --quant {quant} disagree: both name the GGUF type; pass one")
    if quant in LLAMA_CPP_QUANTS:
        require_llama_cpp(f"--quant {quant}")
    return quant


def calibration_source(imatrix: str, dtype: str | None, adapter: Path):
    """(the data source, max_length) --imatrix names: "train" for the run's training data."""
    from hivetune.data.sources import DataSource, source_exists, train_source

    if dtype not in LLAMA_CPP_QUANTS:
        raise UserError(f"--imatrix: only with --quant {', '.join(LLAMA_CPP_QUANTS)} (llama.cpp's quantizer "
                        f"weighs by it)")
    if imatrix == "train":
        from hivetune.core.config import adapter_run_config, load_config

        config = adapter_run_config(adapter)
        if config is None:
            raise UserError(f"--imatrix train: {adapter.parent / 'config.yaml'} not found (an adapter folder alone "
                            f"names no training data): pass --imatrix DATA")
        cfg = load_config(config, {})
        source, max_length = train_source(cfg), cfg.max_length
    else:
        source, max_length = DataSource(imatrix), 2048
    if not source_exists(source):
        raise UserError(f"--imatrix: {source.spec}: data not found")
    return source, max_length


def measure_importance(net, tokenizer, source, max_length: int) -> dict:
    """model.imatrix over the first TOKENS tokens of `source`, with one line saying so."""
    import time

    from hivetune.data.dataset import calibration_sequences
    from hivetune.model.imatrix import TOKENS, importance_matrix

    start = time.perf_counter()
    importance, tokens = importance_matrix(net, calibration_sequences(source, tokenizer, max_length, TOKENS))
    print(f"hivetune: export: importance matrix from {tokens:,} tokens of {source.spec} "
          f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return importance


def finished_adapter(run: Path) -> Path:
    """The adapter folder of a finished run (RUN/adapter) or an adapter folder itself."""
    from hivetune.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    if not run.exists():
        raise UserError(f"{run}: run folder not found")
    for folder in (run / "adapter", run):
        if (folder / ADAPTER_CONFIG).is_file() and (folder / ADAPTER_WEIGHTS).is_file():
            return folder
    raise UserError(f"{run}: no finished adapter (adapter/{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}); "
                    f"finish the run with `hivetune train --resume {run}`")


def base_model_path(adapter: Path, model: str) -> Path:
    from hivetune.core.hub import model_path, split_hub_id

    if model:
        return model_path(model)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    named = cfg.get("base_model_name_or_path") or ""
    if named and not Path(named).exists() and split_hub_id(named) is None:
        raise UserError(f"{adapter}/adapter_config.json: base model {named} not found; pass --model PATH")
    return model_path(named)


def estimate_bytes(format: str, dtype: str | None, args, adapter: Path) -> int:
    """What the export writes, from the architecture alone (no weights read)."""
    from hivetune.model.gguf_write import estimate_gguf_bytes

    adapter_bytes = sum(p.stat().st_size for p in adapter.iterdir() if p.is_file())
    if format == "adapter":
        return adapter_bytes + MARGIN_BYTES
    if format == "merged":
        with torch.device("meta"):
            from hivetune.model.decoder import CausalLM

            n = sum(p.numel() for p in CausalLM(args).parameters())
        return n * BYTES[dtype] + MARGIN_BYTES
    if dtype in LLAMA_CPP_QUANTS:  # the f16 file, then the quantized one beside it
        f16 = estimate_gguf_bytes(args, "f16")
        return f16 + int(f16 * MAX_BITS_PER_WEIGHT / 16) + adapter_bytes + MARGIN_BYTES
    return estimate_gguf_bytes(args, dtype) + adapter_bytes + MARGIN_BYTES


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def check_free_space(out: Path, need: int) -> None:
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < need:
        raise UserError(f"{out}: not enough free disk space: the export needs about {human_bytes(need)}, "
                        f"{parent} has {human_bytes(free)} free")


# ------------------------------------------------------------------------------ sources


def load_merged_source(base: Path, adapter: Path):
    """The base in fp32 on the CPU with the adapter applied (merged when written) and its tokenizer.
    A run trained on a quantized base (base_quant in its config.yaml) gets the base it trained on:
    quantized as in training, then dequantized (model.quant), with one line saying so (a keep
    run's GGUF loads dense as its blocks dequantized: the same values)."""
    from hivetune.model.load import load_model
    from hivetune.model.lora import load_adapter
    from hivetune.model.quant import dequantize_model
    from hivetune.model.tokenizer import load_tokenizer
    from hivetune.workflows.generate import run_base_quant

    tokenizer = load_tokenizer(str(base))
    quant = run_base_quant(adapter)
    net = load_model(base, dtype=torch.float32, device="cpu", base_quant=quant if quant != "keep" else "none")
    load_adapter(net, adapter, param_dtype=torch.float32)
    if quant != "none":
        dequantize_model(net)
        print(f"hivetune: export: the run trained on a {quant} base: the update is merged into its dequantized "
              f"weights; merging into a quantized base changes the weights (the adapter on the {quant} base "
              f"keeps them)", file=sys.stderr)
    return net.eval(), tokenizer


def run_summary(adapter: Path) -> dict:
    """Training facts for the model card: the run's summary.json and the adapter config."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    facts = {"r": cfg.get("r"), "alpha": cfg.get("lora_alpha"), "targets": cfg.get("target_modules"),
             "rslora": cfg.get("use_rslora", False)}
    summary = adapter.parent / "summary.json"
    if summary.is_file():
        try:
            s = json.loads(summary.read_text())
            facts.update(steps=s.get("steps"), final_loss=s.get("final_loss"))
        except (OSError, json.JSONDecodeError):
            pass
    return facts


def model_card(title: str, base: Path, adapter: Path, body: str, library: str) -> str:
    f = run_summary(adapter)
    trained = f"{f['steps']} steps, final loss {f['final_loss']:.4f}" if f.get("steps") else "see the run folder"
    return (f"---\nbase_model: {base}\nlibrary_name: {library}\ntags:\n- hivetune\n- lora\n---\n\n"
            f"# {title}\n\nLoRA fine-tune of `{base}` made with hivetune (r={f['r']}, alpha={f['alpha']}"
            f"{', rsLoRA' if f['rslora'] else ''}, targets {', '.join(f['targets'] or [])}; {trained}).\n\n"
            f"{body}")


# ------------------------------------------------------------------------------ adapter


def write_adapter(tmp: Path, adapter: Path, base: Path) -> ExportResult:
    from hivetune.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copy2(adapter / name, tmp / name)
    body = ("## Use\n\n```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n\n"
            f"base = AutoModelForCausalLM.from_pretrained(\"{base.parent if base.suffix == '.gguf' else base}\""
            f"{', gguf_file=' + repr(base.name) if base.suffix == '.gguf' else ''})\n"
            "model = PeftModel.from_pretrained(base, \"THIS_FOLDER\")\n```\n\n"
            "or `hivetune generate --adapter THIS_FOLDER \"your prompt\"`.\n")
    (tmp / "README.md").write_text(model_card("LoRA adapter", base, adapter, body, "peft"))
    return ExportResult(tmp, "adapter", None, sorted(p.name for p in tmp.iterdir()))


# ------------------------------------------------------------------------------ merged


def merged_state(net) -> list[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) of the merged model; tied lm_head left out as transformers does."""
    from hivetune.model.gguf_write import model_tensors

    with torch.no_grad():
        return [(name, produce()) for name, produce, _ in model_tensors(net)]


def write_safetensors_shards(tmp: Path, tensors: list[tuple[str, torch.Tensor]], dtype: str,
                             shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    torch_dtype = TORCH_DTYPES[dtype]
    shards, current, size = [], [], 0
    for name, t in tensors:
        nbytes = t.numel() * BYTES[dtype]
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for shard, fname in zip(shards, names):
        data = {name: t.to(torch_dtype).contiguous() for name, t in shard}
        save_file(data, str(tmp / fname), {"format": "pt"})
        for name, t in data.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def save_tokenizer(tmp: Path, tokenizer) -> None:
    """tokenizer.json + tokenizer_config.json (chat_template inside too, for older readers)."""
    tokenizer.save_pretrained(str(tmp))
    template = getattr(tokenizer, "chat_template", None)
    config_path = tmp / "tokenizer_config.json"
    if template and config_path.exists():
        cfg = json.loads(config_path.read_text())
        cfg["chat_template"] = template
        config_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def write_merged(tmp: Path, net, tokenizer, dtype: str, base: Path, adapter: Path, shard_bytes: int) -> ExportResult:
    args = net.args
    cfg = args.to_hf_dict()
    cfg["dtype"] = cfg["torch_dtype"] = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype]
    for key, value in (("bos_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id),
                       ("pad_token_id", tokenizer.pad_token_id)):
        if cfg.get(key) is None and value is not None:
            cfg[key] = value
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    generation["do_sample"] = False
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_safetensors_shards(tmp, merged_state(net), dtype, shard_bytes)
    save_tokenizer(tmp, tokenizer)
    body = ("The LoRA update is merged into the weights: load it like any transformers model.\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            "model = AutoModelForCausalLM.from_pretrained(\"THIS_FOLDER\")\n"
            "tokenizer = AutoTokenizer.from_pretrained(\"THIS_FOLDER\")\n```\n\n"
            "or `hivetune chat --model THIS_FOLDER`.\n")
    (tmp / "README.md").write_text(model_card("Merged model", base, adapter, body, "transformers"))
    return ExportResult(tmp, "merged", dtype, sorted(p.name for p in tmp.iterdir()))


# ------------------------------------------------------------------------------ gguf

CHATML_TEMPLATE = (
    '{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
    '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
    '<|im_start|>assistant\n')
LLAMA3_TEMPLATE = (
    '{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}'
    '{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}'
    '<|start_header_id|>assistant<|end_header_id|>\n\n')


def modelfile(model_file: str, chat_template: str | None, eos: str | None, adapter_file: str = "") -> str:
    """An Ollama Modelfile; TEMPLATE translated from the Jinja chat template for ChatML and
    Llama 3 (others are left to Ollama, which reads the GGUF's tokenizer.chat_template)."""
    lines = [f"FROM {model_file}"]
    if adapter_file:
        lines.append(f"ADAPTER {adapter_file}")
    template = chat_template or ""
    stops = []
    if "<|im_start|>" in template:
        lines.append(f'TEMPLATE """{CHATML_TEMPLATE}"""')
        stops.append("<|im_end|>")
        default_system = re.search(r"<\|im_start\|>system(?:\\n|\n)(.+?)<\|im_end\|>", template)
        if default_system and "{{" not in default_system.group(1):
            lines.append(f'SYSTEM """{default_system.group(1)}"""')
    elif "<|start_header_id|>" in template:
        lines.append(f'TEMPLATE """{LLAMA3_TEMPLATE}"""')
        stops.append("<|eot_id|>")
    else:
        lines.append("# TEMPLATE not derived: Ollama uses the chat template stored in the GGUF")
    if eos and eos not in stops:
        stops.append(eos)
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    lines.append("PARAMETER temperature 0")
    return "\n".join(lines) + "\n"


def write_gguf(tmp: Path, net, tokenizer, dtype: str, base: Path, adapter: Path, out: Path,
               importance: dict | None = None) -> ExportResult:
    from hivetune.model.gguf_quantize import quantize_gguf
    from hivetune.model.gguf_write import gguf_context_length, window_note, write_lora_gguf, write_model_gguf
    from hivetune.model.load import is_gguf

    model_file, lora_file = f"model-{dtype}.gguf", "lora-adapter.gguf"
    name = f"{base.stem} + hivetune LoRA"
    window = window_note(net.args)
    if window:
        print(f"hivetune: export: {window}", file=sys.stderr)
    if dtype in LLAMA_CPP_QUANTS:
        f16_file = tmp / ".model-f16.gguf"
        write_model_gguf(f16_file, net, "f16", name, tokenizer, base)
        fallback = quantize_gguf(f16_file, tmp / model_file, dtype, imatrix=importance)
        f16_file.unlink()
        if fallback:  # rows not a multiple of 256 values: those tensors get llama.cpp's fallback type
            print(f"hivetune: export: {dtype}: {fallback} got llama.cpp's fallback type "
                  f"(rows not a multiple of 256 values)", file=sys.stderr)
    else:
        write_model_gguf(tmp / model_file, net, dtype, name, tokenizer, base)
    write_lora_gguf(tmp / lora_file, net, f"hivetune LoRA for {base.stem}", str(adapter))
    template = getattr(tokenizer, "chat_template", None)
    eos = tokenizer.eos_token
    (tmp / "Modelfile").write_text(modelfile(f"./{model_file}", template, eos))
    base_gguf = str(base.absolute()) if is_gguf(base) else "BASE.gguf"
    (tmp / "Modelfile.adapter").write_text(modelfile(base_gguf, template, eos, f"./{lora_file}"))
    here = out.absolute()
    ctx = min(4096, gguf_context_length(net.args))
    server = (f"llama-server -m {here / model_file} --jinja -c {ctx} --port 8080")
    server_lora = f"llama-server -m {base_gguf} --lora {here / lora_file} --jinja -c {ctx} --port 8080"
    ollama = f"cd {here} && ollama create my-model -f Modelfile && ollama run my-model"
    note = "" if is_gguf(base) else f"#   (BASE.gguf: {base} converted to GGUF, f16)\n"
    (tmp / "llama-server.sh").write_text(
        "#!/bin/sh\n# Serve the merged model (OpenAI-compatible API on http://127.0.0.1:8080/v1):\n"
        f"exec {server}\n# Or the base model with the LoRA adapter applied at run time:\n# {server_lora}\n" + note)
    os.chmod(tmp / "llama-server.sh", 0o755)
    commands = (f"llama.cpp:  {server}\n"
                f"  or base + LoRA adapter:  {server_lora}\n"
                f"Ollama:     {ollama}\n"
                f"  (Modelfile.adapter: the base with ADAPTER ./{lora_file})")
    made = ", quantized by llama.cpp from hivetune's f16" if dtype in LLAMA_CPP_QUANTS else ""
    if importance:
        made += " with an importance matrix"
    body = (f"Files: `{model_file}` (the merged model, {dtype}{made}), `{lora_file}` (the LoRA update alone, "
            f"for `llama-server --lora`), `Modelfile` / `Modelfile.adapter` (Ollama), `llama-server.sh`.\n\n"
            f"```sh\n{commands}\n```\n")
    (tmp / "README.md").write_text(model_card("GGUF export", base, adapter, body, "gguf"))
    return ExportResult(tmp, "gguf", dtype, sorted(p.name for p in tmp.iterdir()), commands)

