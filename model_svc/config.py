"""ModelConfig: the architecture facts the model code needs, read once from a local
Hugging Face directory (config.json, generation_config.json).

Works with the config objects of transformers 4.5x and 5.x (rope_theta/rope_scaling vs
rope_parameters) and with a plain config.json dict. Family quirks are settled here, so the
model code only reads flags (attention_bias, qk_norm, ...).

Sliding-window attention is decided per layer the way transformers 5 decides it: Mistral
slides every layer when `sliding_window` is set (it ignores `layer_types`); Qwen2/Qwen3 have a
window only with `use_sliding_window`, and a layer slides when `layer_types[i]` is
"sliding_attention" (absent, it is derived: layers i >= `max_window_layers` slide); Llama
never slides. A query at position p of a sliding layer sees the keys at positions
p - window < k <= p.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contracts.kv_groups import KVGroups, kv_groups

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary-embedding variant. 'default': no scaling; 'linear': positions / factor;
    'llama3': the Llama 3.1 frequency-dependent smoothing."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    family: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    architecture: str  # e.g. "LlamaForCausalLM" (the family's usual one when the config names none)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on the q/k/v projections
    o_proj_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # bias on gate/up/down (Llama's mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3)
    rope_scaling: RopeScaling = RopeScaling()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: torch.dtype = torch.float32  # dtype the checkpoint was saved in
    # Per layer: its sliding window (0: full attention); () when no layer slides.
    layer_windows: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_window(self, layer: int) -> int:
        """The sliding window of one layer; 0: full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def kv_groups(self) -> KVGroups:
        """The layers' KV-cache groups (contracts.kv_groups): one per attention type and size."""
        return kv_groups(self.layer_windows, self.num_hidden_layers)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read config.json (and generation_config.json for extra EOS ids) from a local dir."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory not found: {str(path)!r}")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
        raw = json.loads(config_file.read_text())
        family = _check_family(raw.get("model_type"))
        hf_config: Any = raw
        if not names_family_defaults(family, raw):
            try:  # the transformers config class fills in its family defaults for absent keys
                from transformers import AutoConfig

                hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
            except (ImportError, ValueError, KeyError, OSError):  # transformers absent or too old
                pass
        extra_eos: list[int] = []
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            extra_eos = _as_int_list(json.loads(gen_file.read_text()).get("eos_token_id"))
        return cls.from_hf_config(hf_config, extra_eos_token_ids=extra_eos)

    @classmethod
    def from_hf_config(cls, hf_config: Any, extra_eos_token_ids: list[int] | tuple[int, ...] = ()) -> ModelConfig:
        """Build from a transformers PretrainedConfig (4.5x or 5.x) or a config.json dict."""

        def get(name: str, default: Any = None) -> Any:
            value = hf_config.get(name, default) if isinstance(hf_config, dict) else getattr(hf_config, name, default)
            return default if value is None else value

        family = _check_family(get("model_type"))
        hidden, num_heads = int(get("hidden_size")), int(get("num_attention_heads"))
        max_pos = int(get("max_position_embeddings", 2048))
        num_layers = int(get("num_hidden_layers"))
        layer_windows = _parse_layer_windows(family, get, num_layers)
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {get('hidden_act')!r} for {family}; expected 'silu'")
        rope_theta, rope_scaling = _parse_rope(get, max_pos)

        # Llama and Qwen3: attention_bias puts a bias on q/k/v/o; Qwen2: always on q/k/v only.
        attn_bias = family in ("llama", "qwen3") and bool(get("attention_bias", False))
        eos_ids: list[int] = []
        for tok in _as_int_list(get("eos_token_id")) + list(extra_eos_token_ids):
            if tok not in eos_ids:
                eos_ids.append(tok)
        architectures = get("architectures", []) or []
        return cls(
            family=family,
            architecture=str(architectures[0]) if architectures else _DEFAULT_ARCHITECTURES[family],
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("num_key_value_heads", num_heads)),
            head_dim=int(get("head_dim", hidden // num_heads)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=attn_bias or family == "qwen2",
            o_proj_bias=attn_bias,
            mlp_bias=family == "llama" and bool(get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            rope_scaling=rope_scaling,
            eos_token_ids=tuple(eos_ids),
            bos_token_id=_as_int_list(get("bos_token_id"))[0] if get("bos_token_id") is not None else None,
            torch_dtype=_parse_dtype(get("dtype") or _legacy_dtype(hf_config)),
            layer_windows=layer_windows,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers (4.5x and 5.x) and from_pretrained read back."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": self.rope_scaling.rope_type}
        if self.rope_scaling.rope_type != "default":
            s = self.rope_scaling
            rope.update(
                factor=s.factor,
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
        dtype = str(self.torch_dtype).removeprefix("torch.")
        eos: Any = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (self.eos_token_ids or [None])[0]
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": rope if self.rope_scaling.rope_type != "default" else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "dtype": dtype,
            "torch_dtype": dtype,
        }
        if self.family in ("llama", "qwen3"):
            out["attention_bias"] = self.o_proj_bias
        if self.family == "llama":
            out["mlp_bias"] = self.mlp_bias
        window = max(self.layer_windows, default=0)
        if self.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = window > 0
            out["sliding_window"] = window or None
            if window:
                out["layer_types"] = [
                    "sliding_attention" if self.layer_window(i) else "full_attention"
                    for i in range(self.num_hidden_layers)
                ]
        if self.family == "mistral":
            out["sliding_window"] = window or None
        return out


_DEFAULT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


# The keys whose default is the family's own (transformers' config classes: Llama's EOS id 2,
# Qwen3's head_dim 128, Mistral's window 4096, ...). A config.json that names each of them
# reads the same as a dict as through its config class (tests/model/test_model_config.py), so
# transformers, whose import takes seconds of a start-up, is needed only when one is absent.
_FAMILY_DEFAULTED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "bos_token_id",
    "eos_token_id",
)  # fmt: skip
_FAMILY_DEFAULTED_BY_FAMILY = {"qwen3": ("head_dim",), "mistral": ("sliding_window",)}


def names_family_defaults(family: str, raw: dict[str, Any]) -> bool:
    """Whether config.json `raw` gives every key whose absence the family's config class would
    fill with a default of its own."""
    needed = [*_FAMILY_DEFAULTED, *_FAMILY_DEFAULTED_BY_FAMILY.get(family, ())]
    if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        needed.append("sliding_window")
    return all(key in raw for key in needed) and ("rope_theta" in raw or "rope_parameters" in raw)


def _check_family(model_type: Any) -> str:
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}")
    return str(model_type)


def _parse_layer_windows(family: str, get: Any, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full), () when none slides; see the module docstring."""
    if family == "llama":
        return ()
    window = get("sliding_window")
    if family == "mistral":
        return (_check_window(window),) * num_layers if window is not None else ()
    if not get("use_sliding_window", False):
        window = None  # what Qwen2Config / Qwen3Config do with the flag off
    max_window_layers = int(get("max_window_layers", 28))
    layer_types = list(get("layer_types") or []) or [
        "sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
        for i in range(num_layers)
    ]
    if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"layer_types must name 'full_attention' or 'sliding_attention' for each of the "
            f"{num_layers} layers, got {layer_types!r}"
        )
    if "sliding_attention" not in layer_types:
        return ()
    if window is None:
        raise ValueError(f"{family}: layer_types has sliding layers but use_sliding_window/sliding_window is not set")
    size = _check_window(window)
    return tuple(size if t == "sliding_attention" else 0 for t in layer_types)


def _check_window(window: Any) -> int:
    if int(window) < 1:
        raise ValueError(f"sliding_window must be at least 1, got {window!r}")
    return int(window)


def _parse_rope(get: Any, max_pos: int) -> tuple[float, RopeScaling]:
    """transformers 5: rope_parameters holds rope_theta and the scaling keys; 4.x: rope_theta
    is top level and rope_scaling holds the scaling keys (older configs say 'type')."""
    params = dict(get("rope_parameters") or get("rope_scaling") or {})
    if params and not isinstance(next(iter(params.values())), (int, float, str, type(None))):
        raise ValueError(f"per-layer-type rope parameters are not supported: {params!r}")
    theta = float(params.get("rope_theta") or get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {params['partial_rotary_factor']!r}")
    if rope_type == "default":
        return theta, RopeScaling()
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings") or max_pos),
    )
    return theta, scaling


def _legacy_dtype(hf_config: Any) -> Any:
    """transformers < 4.56 and old config.json files call it torch_dtype (5.x warns on it)."""
    if isinstance(hf_config, dict):
        return hf_config.get("torch_dtype")
    return None if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)


def _as_int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _parse_dtype(value: Any) -> torch.dtype:
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {value!r} in model config")
    return dtype
