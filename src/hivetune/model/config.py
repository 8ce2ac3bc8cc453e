"""Architecture description of a Llama-family decoder, read from HF config.json or GGUF metadata.

One dataclass covers Llama 2/3 (incl. llama3 rope scaling), Qwen2/2.5 (qkv bias), Qwen3
(q/k RMSNorm), Mistral (sliding window), SmolLM2, Gemma 2 / Gemma 3 text (model.families: GeGLU,
sandwich norms, soft-capping, local/global layers) and Phi-3 / Phi-4-mini (fused q/k/v and
gate/up, partial rotary, longrope): they differ only in the fields below.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from hivetune.core.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
ROPE_TYPES = ("default", "llama3", "linear", "longrope")  # "su" is Phi-3's older name of longrope
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


@dataclass
class ModelArgs:
    """Shape and numerics of a decoder; field names follow HF's config.json where one exists."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v (Qwen2 always; Llama when set)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    rope_freq_factors: list[float] | None = None  # GGUF's rope_freqs tensor: inv_freq / factor
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hidden_act: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_pytorch_tanh (Gemma's GeGLU)
    sliding_window: int | None = None  # keys within this many positions of the query (windowed layers)
    layer_types: list[str] | None = None  # per layer "sliding_attention" / "full_attention"; None: all full
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar^-0.5 (Gemma)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims (Phi-4-mini)
    extra: dict = field(default_factory=dict, repr=False)  # the source config, kept for export

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer, None for a global one."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def linear_weight_count(self) -> int:
        """Parameters of all matmul weights incl. the LM head: N in the 6N / 4N FLOP rules."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        mlp = 3 * h * self.intermediate_size
        return self.num_hidden_layers * (attn + mlp) + self.vocab_size * h

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str = "config.json") -> "ModelArgs":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise UserError(f"{source}: missing keys {', '.join(missing)}")
        # transformers >= 5 moved rope_theta and rope_scaling into rope_parameters (Gemma 3: one
        # dict per layer type, full_attention and sliding_attention).
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        local = rope.pop("sliding_attention", None)
        rope = dict(rope.pop("full_attention", None) or rope)
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type
        if rope_type not in ROPE_TYPES:
            raise UserError(f"{source}: rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        rope_scaling = dict(rope, rope_type=rope_type) if rope_type != "default" else None
        if rope_type == "longrope":
            rope_scaling.setdefault("original_max_position_embeddings",
                                    cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")))
        family = family_fields(model_type, cfg, local)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or 0,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            extra=dict(cfg),
            **family,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelArgs":
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path}: not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: not a readable JSON config ({e})") from None
        if not isinstance(cfg, dict):
            raise UserError(f"{path}: expected a JSON object")
        return cls.from_hf_dict(cfg, source=str(path))

    def to_hf_dict(self) -> dict:
        """A config.json that transformers reads back to the same architecture."""
        arch = HF_ARCHITECTURES[self.model_type]
        out = {k: v for k, v in self.extra.items() if k not in ("rope_parameters",)}
        out.update(
            architectures=[arch],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
        )
        if self.model_type in ("gemma2", "gemma3_text"):
            out["hidden_activation"] = self.hidden_act
        if self.rope_local_theta is not None:
            out["rope_local_base_freq"] = self.rope_local_theta
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        return out

    def replace(self, **changes) -> "ModelArgs":
        return dataclasses.replace(self, **changes)


def checkpointed_count(layers: int, checkpointing: bool, first: int = 0) -> int:
    """How many decoder layers (the first ones) run under gradient checkpointing: none without it,
    else the first `first` (train's checkpoint_layers; 0: all `layers`)."""
    if not checkpointing:
        return 0
    return min(first, layers) if first else layers


def family_fields(model_type: str, cfg: dict, local_rope: dict | None) -> dict:
    """ModelArgs fields beyond the Llama shape: windows, Gemma's numerics, Phi-3's partial RoPE."""
    out = {}
    window = cfg.get("sliding_window")
    if model_type in ("mistral", "phi3", "gemma2", "gemma3_text") and window:
        out["sliding_window"] = int(window)
        if model_type in ("gemma2", "gemma3_text"):
            out["layer_types"] = list(cfg.get("layer_types") or gemma_layer_types(model_type, cfg))
    if model_type in ("gemma2", "gemma3_text"):
        out.update(hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
                   query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
                   attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                   final_logit_softcapping=cfg.get("final_logit_softcapping"))
    if model_type == "gemma3_text":
        out["rope_local_theta"] = float((local_rope or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    if model_type == "phi3":
        rope = cfg.get("rope_parameters") or {}
        out["partial_rotary_factor"] = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 1.0))
    return out


def gemma_layer_types(model_type: str, cfg: dict) -> list[str]:
    """Gemma 2: sliding, full, sliding, ...; Gemma 3: every sliding_window_pattern-th layer full."""
    pattern = 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern") or 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg["num_hidden_layers"])]


def qwen25_shape(vocab, hidden, intermediate, layers, heads, kv, tied) -> ModelArgs:
    """A Qwen2.5-shaped architecture (the benchmarks' workloads, the planner's calibration)."""
    return ModelArgs(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                     rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
                     tie_word_embeddings=tied, attention_bias=True, model_type="qwen2")


def qwen3_shape(vocab, hidden, intermediate, layers, heads, kv, head_dim, tied) -> ModelArgs:
    """A Qwen3-shaped architecture: q/k RMSNorm on each head, an explicit head_dim, no qkv bias."""
    return ModelArgs(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                     head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                     tie_word_embeddings=tied, qk_norm=True, model_type="qwen3")
