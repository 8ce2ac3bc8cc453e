"""Write a decoder (and a LoRA adapter) as GGUF files that llama.cpp, Ollama and transformers read.

The layout is the inverse of ``hivetune.model.load``'s reader: llama.cpp tensor names
(``blk.N.attn_q.weight`` ...), q/k rows permuted for llama.cpp's interleaved RoPE in the llama
family (Qwen, Gemma and Phi-3 use NEOX RoPE and stay in HF order), norms and biases in f32,
hyperparameters under ``<arch>.*`` and the tokenizer plus chat template under ``tokenizer.*``
(model.gguf_vocab). Gemma's norms are written as (1 + w), as llama.cpp's converter does; Phi-3's
joined qkv_proj / gate_up_proj go as attn_qkv / ffn_up, which llama.cpp splits itself.

Tensors are streamed: all tensor infos first, then one tensor at a time is computed (LoRA merged
in fp32), converted and written, so memory holds the model once, not twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from hivetune.core.errors import UserError
from hivetune.model.config import ModelArgs
from hivetune.model.decoder import CausalLM, rope_inv_freq
from hivetune.model.gguf_vocab import add_tokenizer, llama_cpp_name
from hivetune.model.load import (GEMMA_27B_LAYERS, GGUF_FAMILY_LAYER_NAMES, GGUF_LAYER_NAMES, GGUF_TOP_NAMES,
                                 gguf_gemma_query_scalar, permute_rope_rows)

# Our model_type -> llama.cpp architecture. llama.cpp's converter writes Mistral as "llama".
GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
              "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
# Families whose sliding window llama.cpp does not run: its llama graph (Mistral's) has none, and it
# reads Phi-3's and turns it off ("Phi SWA is currently disabled"). Past the window its attention
# differs from the model's, so their GGUF's context length is the window.
WINDOW_NOT_RUN = ("mistral", "phi3")
# Where a family's names differ from the llama table (HF module -> llama.cpp tensor)
FAMILY_LAYER_NAMES = {f: {hf: g for g, hf in names.items()} for f, names in GGUF_FAMILY_LAYER_NAMES.items()}
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")
HF_TO_GGUF_LAYER = {hf: g for g, hf in GGUF_LAYER_NAMES.items()}
HF_TO_GGUF_TOP = {hf: g for g, hf in GGUF_TOP_NAMES.items()}


def gguf_arch(args: ModelArgs, source: str) -> str:
    arch = GGUF_ARCHS.get(args.model_type)
    if arch is None:
        raise UserError(f"{source}: GGUF export supports {', '.join(GGUF_ARCHS)} models, not {args.model_type!r}")
    return arch


def gguf_context_length(args: ModelArgs) -> int:
    """The GGUF's context length: the trained one, or the sliding window where llama.cpp runs the
    family without it (longer texts would attend past the window, as the model never did)."""
    window = args.sliding_window if args.model_type in WINDOW_NOT_RUN else None
    return min(window, args.max_position_embeddings) if window else args.max_position_embeddings


def window_note(args: ModelArgs) -> str | None:
    """The export's one line when the context length written is the window, else None."""
    context = gguf_context_length(args)
    if context == args.max_position_embeddings:
        return None
    return (f"{args.model_type}'s sliding window of {context} tokens is not run by llama.cpp's "
            f"{GGUF_ARCHS[args.model_type]} graph: the GGUF's context length is {context}, not "
            f"{args.max_position_embeddings}; longer texts answer differently in llama.cpp")


def family_of(model_type: str) -> str:
    return "gemma" if model_type.startswith("gemma") else model_type


def hf_to_gguf_name(name: str, model_type: str = "llama") -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight"""
    if name in HF_TO_GGUF_TOP:
        return HF_TO_GGUF_TOP[name]
    parts = name.split(".")  # model, layers, N, <module...>, weight|bias
    module = ".".join(parts[3:-1])
    table = {**HF_TO_GGUF_LAYER, **FAMILY_LAYER_NAMES.get(family_of(model_type), {})}
    return f"blk.{parts[2]}.{table[module]}.{parts[-1]}"


def qtype_for(dtype: str, shape: tuple[int, ...]):
    """The ggml type of one tensor: 1-D tensors (norms, biases) stay f32 as llama.cpp's
    converter keeps them; q8_0 needs rows that are a multiple of its 32-value block, else f16."""
    from gguf import GGMLQuantizationType as Q

    if len(shape) == 1 or dtype == "f32":
        return Q.F32
    if dtype == "q8_0" and shape[-1] % 32 != 0:
        return Q.F16
    return {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[dtype]


def file_type(dtype: str):
    from gguf import LlamaFileType as F

    return {"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0}[dtype]


def tensor_nbytes(shape: tuple[int, ...], qtype) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


def estimate_gguf_bytes(args: ModelArgs, dtype: str) -> int:
    """Bytes of the tensor data of a model GGUF in `dtype` (metadata not counted)."""
    with torch.device("meta"):
        model = CausalLM(args)
    total = 0
    for name, p in model.named_parameters():  # tied lm_head is one parameter: counted once
        shape = tuple(p.shape)
        total += tensor_nbytes(shape, qtype_for(dtype, shape))
    return total


@dataclass
class PlannedTensor:
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy (row-major, PyTorch) shape
    qtype: object  # gguf.GGMLQuantizationType
    produce: Callable[[], np.ndarray]  # fp32 array in `shape`, computed when written


def permute_for_llamacpp(args: ModelArgs, hf_name: str, t: torch.Tensor) -> torch.Tensor:
    """The inverse of the loader's unpermute: HF rotate-half rows -> llama.cpp interleaved rows."""
    if GGUF_ARCHS[args.model_type] != "llama":
        return t
    if ".self_attn.q_proj." in hf_name:
        return permute_rope_rows(t, args.num_attention_heads)
    if ".self_attn.k_proj." in hf_name:
        return permute_rope_rows(t, args.num_key_value_heads)
    return t


def gguf_value(args: ModelArgs, hf_name: str, t: torch.Tensor) -> torch.Tensor:
    """A weight as llama.cpp reads it: q/k rows permuted (llama), Gemma's norms as 1 + w."""
    if args.model_type.startswith("gemma") and hf_name.endswith("norm.weight"):
        return t + 1
    return permute_for_llamacpp(args, hf_name, t)


def model_tensors(model: CausalLM) -> Iterator[tuple[str, Callable[[], torch.Tensor], tuple[int, ...]]]:
    """(HF name, fp32 producer, shape) of every weight, LoRA merged in (W + scale * B A)."""
    from hivetune.model.lora import LoRALinear

    args = model.args
    seen = set()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            seen.add(f"{name}.base_layer.weight")
            yield f"{name}.weight", (lambda m=module: m.merged_weight()), tuple(module.base_layer.weight.shape)
            if module.base_layer.bias is not None:
                seen.add(f"{name}.base_layer.bias")
                yield f"{name}.bias", (lambda m=module: m.base_layer.bias.float()), tuple(module.base_layer.bias.shape)
    for name, p in model.named_parameters():
        if name in seen or ".lora_A." in name or ".lora_B." in name:
            continue
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        yield name, (lambda p=p: p.detach().float()), tuple(p.shape)
    if args.model_type == "phi3" and args.tie_word_embeddings:  # llama.cpp's phi3 graph reads an output tensor
        embed = model.model.embed_tokens.weight
        yield "lm_head.weight", (lambda: embed.detach().float()), tuple(embed.shape)


def plan_model_tensors(model: CausalLM, dtype: str) -> list[PlannedTensor]:
    args = model.args
    plan = []
    for hf_name, produce, shape in model_tensors(model):
        def to_numpy(hf_name=hf_name, produce=produce):
            with torch.no_grad():
                return gguf_value(args, hf_name, produce()).contiguous().numpy()
        plan.append(PlannedTensor(hf_to_gguf_name(hf_name, args.model_type), shape, qtype_for(dtype, shape), to_numpy))
    plan.sort(key=lambda t: _tensor_order(t.name))
    rope = args.rope_scaling or {}
    if rope.get("rope_type") == "longrope":  # Phi-3: both factor lists, llama.cpp picks by context
        from gguf import GGMLQuantizationType as Q
        for which in ("long", "short"):
            f = np.asarray(rope[f"{which}_factor"], dtype=np.float32)
            plan.insert(0, PlannedTensor(f"rope_factors_{which}.weight", f.shape, Q.F32, lambda f=f: f))
    if args.model_type in ("llama", "mistral") and (args.rope_scaling or args.rope_freq_factors):
        # Llama 3 long-context scaling travels as rope_freqs = plain inv_freq / scaled inv_freq.
        factors = (rope_inv_freq(args.replace(rope_scaling=None, rope_freq_factors=None))
                   / rope_inv_freq(args)).numpy().astype(np.float32)
        from gguf import GGMLQuantizationType as Q
        plan.insert(0, PlannedTensor("rope_freqs.weight", factors.shape, Q.F32, lambda f=factors: f))
    return plan


def _tensor_order(name: str):
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name == "token_embd.weight" else 2, 0, name)


def encode_tensor(array: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == Q.F32:
        return array
    if qtype == Q.F16:
        return array.astype(np.float16)
    return quantize(array, qtype)  # uint8 blocks (bf16, q8_0)


def write_tensors(writer, plan: list[PlannedTensor]) -> None:
    """Declare every tensor, write header / metadata / tensor infos, then stream the data."""
    from gguf import GGMLQuantizationType as Q

    for t in plan:
        nbytes = tensor_nbytes(t.shape, t.qtype)
        if t.qtype in (Q.F32, Q.F16):
            writer.add_tensor_info(t.name, t.shape, np.float32 if t.qtype == Q.F32 else np.float16, nbytes)
        else:
            writer.add_tensor_info(t.name, t.shape, np.float32, nbytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in plan:
        data = encode_tensor(t.produce(), t.qtype)
        if tuple(data.shape[:-1]) != t.shape[:-1]:
            raise AssertionError(f"{t.name}: produced {data.shape}, planned {t.shape}")
        writer.write_tensor_data(data)
    writer.close()


def add_hparams(writer, args: ModelArgs, name: str) -> None:
    writer.add_name(name)
    writer.add_type("model")
    writer.add_vocab_size(args.vocab_size)
    writer.add_context_length(gguf_context_length(args))
    writer.add_embedding_length(args.hidden_size)
    writer.add_block_count(args.num_hidden_layers)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_dimension_count(args.rotary_dim)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    if args.model_type in ("gemma2", "gemma3_text", "phi3"):
        add_family_hparams(writer, args)


def add_family_hparams(writer, args: ModelArgs) -> None:
    """Gemma's windows and caps, Phi-3's longrope; what llama.cpp does not do is refused."""
    from gguf import RopeScalingType

    rope = args.rope_scaling or {}
    if args.model_type.startswith("gemma"):
        scalar = args.query_pre_attn_scalar or args.head_dim
        implied = gguf_gemma_query_scalar(args.model_type, args.num_hidden_layers, args.hidden_size,
                                          args.num_attention_heads, args.head_dim)
        if scalar != implied:
            raise UserError(f"query_pre_attn_scalar {scalar}: llama.cpp's Gemma scales attention by head_dim "
                            f"({args.head_dim}), by hidden_size / heads in the 27B shape "
                            f"({GEMMA_27B_LAYERS[args.model_type]} layers); this model would not run as trained")
        if args.sliding_window:
            writer.add_sliding_window(args.sliding_window)
        if args.attn_logit_softcapping:
            writer.add_attn_logit_softcapping(args.attn_logit_softcapping)
        if args.final_logit_softcapping:
            writer.add_final_logit_softcapping(args.final_logit_softcapping)
    if args.model_type == "gemma3_text":
        if args.layer_types and args.sliding_window:
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in args.layer_types])
        if args.rope_local_theta:
            writer.add_rope_freq_base_swa(args.rope_local_theta)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if args.model_type == "phi3" and args.sliding_window:  # as llama.cpp's converter; hivetune's reader runs it
        writer.add_sliding_window(args.sliding_window)
    if args.model_type == "phi3" and rope.get("rope_type") == "longrope":
        from hivetune.model.decoder import longrope_attention_factor

        writer.add_rope_scaling_attn_factors(longrope_attention_factor(args))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


# ------------------------------------------------------------------------------ tokenizer


def copy_gguf_tokenizer(writer, source: Path) -> None:
    """Every tokenizer.* key of a source GGUF, as is (vocab, merges, types, ids, template)."""
    from gguf import GGUFValueType

    from hivetune.model.load import open_gguf

    reader = open_gguf(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


# ------------------------------------------------------------------------------ files


def write_model_gguf(path: Path, model: CausalLM, dtype: str, name: str, tokenizer, source_model: Path) -> None:
    """The whole model (LoRA merged) as one GGUF file in `dtype`."""
    import gguf

    from hivetune.model.load import is_gguf

    args = model.args
    writer = gguf.GGUFWriter(str(path), gguf_arch(args, str(source_model)))
    add_hparams(writer, args, llama_cpp_name(name, tokenizer))
    writer.add_file_type(file_type(dtype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if is_gguf(source_model):
        copy_gguf_tokenizer(writer, source_model)
    else:
        eos = args.eos_token_id[0] if isinstance(args.eos_token_id, list) else args.eos_token_id
        add_tokenizer(writer, tokenizer, args.vocab_size, source_model, eos)
    write_tensors(writer, plan_model_tensors(model, dtype))


def write_lora_gguf(path: Path, model: CausalLM, name: str, source: str) -> int:
    """The LoRA update alone, for ``llama-server --lora``: per target ``<tensor>.lora_a`` [r, in]
    and ``.lora_b`` [out, r]. llama.cpp scales by alpha / r, so rsLoRA's alpha / sqrt(r) is
    written as alpha * sqrt(r). B's rows get the q/k permutation (P W = P B A). Returns the count."""
    import math

    import gguf

    from hivetune.model.lora import lora_modules

    args = model.args
    modules = lora_modules(model)
    if not modules:
        raise UserError(f"{source}: the model has no LoRA modules to write")
    first = modules[0][1]
    r = first.lora_A.out_features
    if any(m.lora_A.out_features != r or not math.isclose(m.scaling, first.scaling) for _, m in modules):
        raise UserError(f"{source}: LoRA modules differ in rank or scale; a GGUF adapter holds one alpha")
    writer = gguf.GGUFWriter(str(path), gguf_arch(args, source))
    writer.add_name(name)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(first.scaling * r))
    plan = []
    for mod_name, m in modules:
        base = hf_to_gguf_name(f"{mod_name}.weight", args.model_type)
        a, b = m.lora_A.weight, m.lora_B.weight
        plan.append(PlannedTensor(f"{base}.lora_a", tuple(a.shape), gguf.GGMLQuantizationType.F32,
                                  lambda a=a: a.detach().float().numpy()))
        plan.append(PlannedTensor(
            f"{base}.lora_b", tuple(b.shape), gguf.GGMLQuantizationType.F32,
            lambda b=b, n=mod_name: permute_for_llamacpp(args, n + ".weight", b.detach().float()).contiguous().numpy()))
    plan.sort(key=lambda t: _tensor_order(t.name))
    write_tensors(writer, plan)
    return len(modules)
