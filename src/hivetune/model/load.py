"""Load a decoder from an HF folder (config.json + safetensors, sharded or not) or a GGUF file.

Weights go straight into the requested dtype: the model is built on the meta device and each
tensor is assigned once, so a bf16 run never holds an fp32 copy of the base.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hivetune.core.errors import UserError
from hivetune.core.fileio import fill_cache_folder, file_cache_folder
from hivetune.model.config import ModelArgs
from hivetune.model.decoder import CausalLM, rope_buffers
from hivetune.model.quant import GGUFBlocks, place_weight, quantizes, unsupported_block_type
from hivetune.ops.gguf_blocks import BLOCK_TYPES

GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Where a family's llama.cpp names differ from the table above (llama.cpp tensor -> HF module)
GGUF_FAMILY_LAYER_NAMES = {
    "gemma": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# llama.cpp architecture -> our model_type
GGUF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                    "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
# llama.cpp's converter permutes q/k rows of these architectures for its interleaved RoPE.
GGUF_PERMUTED_ARCHS = ("llama", "mistral")
# llama.cpp scales Gemma's attention by hidden / heads in the 27B models (these layer counts), else
# by head_dim: the query_pre_attn_scalar a GGUF implies
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def load_args(path: str | Path) -> ModelArgs:
    """Architecture only, no weights read: a folder, its config.json, or a GGUF file (the config of
    its decoded copy in the cache when load_model made one: parsing the header, the tokenizer's
    arrays included, takes 2.8 s for the embedded SmolLM2 on the 2-core CPU)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: model path not found")
    if is_gguf(path):
        cached = file_cache_folder(path, "models") / "config.json"
        if cached.is_file():  # load_model's decoded copy: its config, without parsing the GGUF's header again
            return ModelArgs.from_hf_dict(json.loads(cached.read_text()), source=str(path))
        return gguf_args(open_gguf(path))
    if path.is_dir():
        path = path / "config.json"
    return ModelArgs.from_json_file(path)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu",
               base_quant: str = "none") -> CausalLM:
    """Build the decoder and fill it from `path`; parameters frozen, in `dtype`, on `device`.
    `base_quant` (nf4, int8, keep): the decoder layers' linear weights quantized as they are
    read, or under keep a GGUF's own blocks kept (model.quant)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: model path not found")
    keep = base_quant == "keep"
    if keep and not is_gguf(path):
        raise UserError(f"base_quant: keep needs a .gguf model (its blocks are kept); {path} is not one: "
                        f"use none, nf4 or int8")
    if is_gguf(path):
        cached = file_cache_folder(path, "models")
        if (cached / "model.safetensors").exists() and not keep:
            args = ModelArgs.from_hf_dict(json.loads((cached / "config.json").read_text()), source=str(path))
            return build_model(args, safetensors_state_dict(cached), dtype, device, str(path), base_quant)
        reader = open_gguf(path)
        args = gguf_args(reader)
        tensors = gguf_state_dict(reader, args, keep)
        if not keep and args.rope_freq_factors is None and path.stat().st_size <= GGUF_CACHE_MAX_BYTES:
            tensors = list(tensors)
            save_gguf_cache(cached, args, tensors)
    else:
        if not path.is_dir():
            raise UserError(f"{path}: expected an HF model folder or a .gguf file")
        args = ModelArgs.from_json_file(path / "config.json")
        tensors = safetensors_state_dict(path)
    return build_model(args, tensors, dtype, device, str(path), base_quant)


# GGUF files up to this size (SmolLM2-135M's is ~100 MB) keep their decoded weights in the cache
# (fp32 safetensors + config, ~4 bytes a parameter): reading a GGUF parses every metadata field,
# the tokenizer's arrays included, and dequantises every tensor, 7.8 s of the embedded model's
# 10 s load on the 2-core CPU; the cached copy loads in a fraction of a second.
GGUF_CACHE_MAX_BYTES = 1 << 30


def save_gguf_cache(folder: Path, args: ModelArgs, tensors: list) -> None:
    """The decoded weights (fp32, as dequantised) and the config: a model folder of its own."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(args.extra))
        save_file({name: t.contiguous() for name, t in tensors}, str(tmp / "model.safetensors"))

    fill_cache_folder(folder, write)


def build_model(args: ModelArgs, tensors, dtype, device, source: str, base_quant: str = "none") -> CausalLM:
    """tensors: iterable of (HF name, tensor or model.quant.GGUFBlocks). Checks names and shapes
    against the architecture; base_quant: model.quant.place_weight takes the linear weights."""
    with torch.device("meta"):
        model = CausalLM(args)
    expected = {name: p.shape for name, p in model.named_parameters()}
    seen = set()
    for name, tensor in tensors:
        if name not in expected:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise UserError(f"{source}: unexpected tensor {name!r} for a {args.model_type} model")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise UserError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {tuple(expected[name])}")
        seen.add(name)
        if place_weight(model, name, tensor, base_quant, dtype, device):
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        value = tensor.to(device=device, dtype=dtype)
        setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))
    missing = set(expected) - seen
    if args.tie_word_embeddings:
        missing.discard("lm_head.weight")
        model.lm_head.weight = model.model.embed_tokens.weight
    if missing:
        raise UserError(f"{source}: missing tensors: {', '.join(sorted(missing)[:5])}"
                        + (" ..." if len(missing) > 5 else ""))
    for name, table in rope_buffers(args).items():
        setattr(model, name, table.to(device) if table is not None else None)
    return model


def safetensors_state_dict(folder: Path):
    from safetensors import safe_open
    from safetensors import SafetensorError

    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder}: no *.safetensors weights")
    for name in files:
        file = folder / name
        if not file.exists():
            raise UserError(f"{file}: listed in the index but missing")
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise UserError(f"{file}: unreadable safetensors ({e})") from None


def open_gguf(path: Path):
    """A gguf.GGUFReader over `path`; a file cut short is a UserError giving the size its
    tensors need and the size it has."""
    reader_class = _sized_reader()
    size = Path(path).stat().st_size
    try:
        reader = reader_class(str(path))
    except Exception as e:  # the reader raises ValueError, struct errors, IndexError ...
        raise UserError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    if reader.needed > size:
        raise UserError(f"{path}: the file is truncated: its tensors need {reader.needed:,} bytes, the file has "
                        f"{size:,} (a download or copy cut short?)")
    return reader


def _sized_reader():
    import gguf  # loaded lazily: only GGUF files need it

    class SizedReader(gguf.GGUFReader):
        """GGUFReader noting the end of the furthest slice it reads (`needed`). A tensor past the
        end of the mapped file comes back as zeros of its full length (a zero-stride view, no
        memory), so the header is read whole and `needed` is the size the file should have."""

        needed = 0

        def _get(self, offset, dtype, count=1, override_order=None):
            itemsize = int(np.empty([], dtype=dtype).itemsize)
            end = int(offset) + itemsize * int(count)
            self.needed = max(self.needed, end)
            if end > len(self.data):
                return np.broadcast_to(np.zeros(1, dtype=dtype), (int(count),))
            return super()._get(offset, dtype, count, override_order)

    return SizedReader


def gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_args(reader) -> ModelArgs:
    arch = gguf_field(reader, "general.architecture")
    model_type = GGUF_MODEL_TYPES.get(arch)
    source = str(reader.data.filename) if hasattr(reader.data, "filename") else "GGUF"
    if model_type is None:
        raise UserError(f"{source}: GGUF architecture {arch!r} is not supported ({', '.join(GGUF_MODEL_TYPES)})")

    def key(name, default=None):
        return gguf_field(reader, f"{arch}.{name}", default)

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens.data) if tokens is not None else None)
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    names = {t.name for t in reader.tensors}
    factors = None
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    cfg = {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length") or (hidden // heads if hidden and heads else None),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    cfg.update(gguf_family_config(reader, model_type, cfg, key))
    args = ModelArgs.from_hf_dict(cfg, source=source)
    args.rope_freq_factors = factors if model_type != "phi3" else None
    return args


def gguf_family_config(reader, model_type: str, cfg: dict, key) -> dict:
    """config.json keys of Gemma and Phi-3 from a GGUF's <arch>.* keys and rope_factors_* tensors."""
    out = {}
    if model_type in ("gemma2", "gemma3_text"):
        out.update(sliding_window=key("attention.sliding_window"),
                   attn_logit_softcapping=key("attn_logit_softcapping"),
                   final_logit_softcapping=key("final_logit_softcapping"),
                   query_pre_attn_scalar=gguf_gemma_query_scalar(model_type, cfg["num_hidden_layers"],
                                                                 cfg["hidden_size"], cfg["num_attention_heads"],
                                                                 cfg["head_dim"]))
        pattern = key("attention.sliding_window_pattern", 2 if model_type == "gemma2" else 6)
        sliding = ([bool(x) for x in pattern] if isinstance(pattern, list)
                   else [bool((i + 1) % pattern) for i in range(cfg["num_hidden_layers"])])
        out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in sliding]
    if model_type == "gemma3_text":
        out["rope_local_base_freq"] = key("rope.freq_base_swa", 10000.0)
        if key("rope.scaling.type") == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    if model_type == "phi3":
        out["sliding_window"] = key("attention.sliding_window")
        rot = key("rope.dimension_count")
        out["partial_rotary_factor"] = rot / cfg["head_dim"] if rot else 1.0
        tensors = {t.name: t for t in reader.tensors}
        if "rope_factors_long.weight" in tensors:
            factors = {w: [float(x) for x in np.asarray(tensors[f"rope_factors_{w}.weight"].data).reshape(-1)]
                       for w in ("long", "short")}
            out["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors["long"],
                                   "short_factor": factors["short"],
                                   "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                                   "attention_factor": key("rope.scaling.attn_factor")}
    return out


def gguf_gemma_query_scalar(model_type: str, layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The query_pre_attn_scalar llama.cpp runs a Gemma GGUF with (it has no key for it)."""
    return hidden // heads if layers == GEMMA_27B_LAYERS[model_type] else head_dim


def gguf_state_dict(reader, args: ModelArgs, keep: bool = False):
    """(HF name, fp32 tensor) pairs: dequantised, llama.cpp's q/k row permutation undone.
    `keep`: the decoder layers' quantized linear weights come as model.quant.GGUFBlocks instead."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
            continue
        name = gguf_to_hf_name(t.name, args.model_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml lists dims innermost first
        if keep and quantizes(name) and int(t.tensor_type) not in GGUF_DENSE_TYPES:
            yield name, kept_blocks(reader, t, name, shape, args)
            continue
        array = np.ascontiguousarray(dequantize(t.data, t.tensor_type).reshape(shape), dtype=np.float32)
        if not array.flags.writeable:
            # F32 tensors come back as views of the reader's read-only memory map: without a
            # copy the parameters would alias the file and an in-place write would segfault.
            array = array.copy()
        tensor = torch.from_numpy(array)
        if args.model_type.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor - 1  # llama.cpp stores Gemma's norms as 1 + w
        if args.model_type in GGUF_PERMUTED_ARCHS:
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                tensor = unpermute_rope_rows(tensor, args.num_attention_heads)
            elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                tensor = unpermute_rope_rows(tensor, args.num_key_value_heads)
        yield name, tensor


GGUF_DENSE_TYPES = (0, 1, 30)  # F32, F16, BF16: loaded dense under keep too


def kept_blocks(reader, t, name: str, shape: tuple[int, int], args: ModelArgs) -> GGUFBlocks:
    """A quantized tensor's blocks, copied out of the file, rows (whole blocks each) unpermuted."""
    if int(t.tensor_type) not in BLOCK_TYPES:
        raise unsupported_block_type(str(getattr(reader.data, "filename", "GGUF")), t.name, t.tensor_type.name)
    raw = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(shape[0], -1))
    if args.model_type in GGUF_PERMUTED_ARCHS:
        if name.endswith("self_attn.q_proj.weight"):
            raw = unpermute_rope_rows(raw, args.num_attention_heads).contiguous()
        elif name.endswith("self_attn.k_proj.weight"):
            raw = unpermute_rope_rows(raw, args.num_key_value_heads).contiguous()
    return GGUFBlocks(raw, int(t.tensor_type), shape)


def gguf_to_hf_name(name: str, model_type: str = "llama") -> str:
    if name in GGUF_TOP_NAMES:
        return GGUF_TOP_NAMES[name]
    parts = name.split(".")
    family = "gemma" if model_type.startswith("gemma") else model_type
    table = {**GGUF_LAYER_NAMES, **GGUF_FAMILY_LAYER_NAMES.get(family, {})}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    return name  # unknown: build_model reports it by name


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF (rotate-half) row order -> llama.cpp (interleaved pairs) row order, per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of ``permute_rope_rows``."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
