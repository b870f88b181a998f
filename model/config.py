"""Qwen3 configuration: a dataclass, named presets, and a reader for Hugging Face config.json.

    cfg = Qwen3Config.preset("qwen3-8b")                    # known shapes, no download
    cfg = Qwen3Config.from_hf("/models/Qwen3-8B")           # a directory, a config.json, or a dict
    cfg = cfg.with_yarn(factor=32, original_max_position_embeddings=32768)

Only what this repository can run is accepted: Qwen3 dense or mixture-of-experts (model_type
"qwen3_moe": Qwen3-30B-A3B and its kin, model/moe.py), and the dense Qwen3.5 / Qwen3.6 hybrids
(model_type "qwen3_5", the multimodal config.json real checkpoints ship with the text model's
fields under text_config, or "qwen3_5_text"; model/qwen3_5.py); no sliding window, SiLU MLP, no
attention bias, RoPE "default" or "yarn". Anything else is refused with a ConfigError (a
ValueError) of one line that names the file and the problem.

A Qwen3.5 config is a Qwen3Config whose layer_types is not empty: each layer is
"linear_attention" (Gated DeltaNet, the linear_* fields) or "full_attention" (gated attention on
the first partial_rotary_factor of each head's dimensions). Its rope_parameters carry an
mrope_section for images and video; for text all three position streams are the token's place, so
the sections pick from one and the same table and the rotation is plain 1-D RoPE.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")  # a Qwen3.5 layer's kinds


class ConfigError(ValueError):
    """A configuration this repository cannot run; the message is one line naming what and why."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (https://arxiv.org/abs/2309.00071), with transformers' defaults."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: 0.1 * ln(factor) + 1, as in the paper
    truncate: bool = True  # round the correction range to whole dimensions, as transformers does

    @property
    def attention_scaling(self) -> float:
        """The factor applied to cos and sin (so to q.k twice: its square scales the logits)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128  # not hidden_size // heads for every size: 0.6B has 1024 / 16 -> 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    yarn: YarnScaling | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645
    # Mixture of experts (Qwen3MoeForCausalLM); num_experts 0: a dense Qwen3.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the chosen experts' probabilities to sum 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight when it is on
    # Qwen3.5 MoE: a shared expert (SwiGLU of this size) beside the routed ones, in every sparse
    # layer, its output scaled by sigmoid(shared_expert_gate(x)); 0: none (Qwen3-MoE)
    shared_expert_intermediate_size: int = 0
    # Qwen3.5 / Qwen3.6 (model/qwen3_5.py); layer_types () is a Qwen3. Gated DeltaNet layers:
    layer_types: tuple[str, ...] = ()  # "linear_attention" or "full_attention", one per layer
    linear_num_key_heads: int = 0  # q and k heads of the delta rule (16 in every real Qwen3.5)
    linear_num_value_heads: int = 0  # v heads; value head j reads key head j // (v / k)
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0  # the depthwise causal conv's width (4)
    # ... and full-attention layers: RoPE on the first head_dim * factor dimensions of a head
    # (64 of 256), and an output gate sigmoid(g) read from q_proj beside each query head.
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"Qwen3Config.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts and not (
            1 <= self.num_experts_per_tok <= self.num_experts
            and self.moe_intermediate_size > 0
            and self.decoder_sparse_step > 0
        ):
            raise ConfigError(
                f"a mixture of experts needs 1 <= num_experts_per_tok ({self.num_experts_per_tok})"
                f" <= num_experts ({self.num_experts}), moe_intermediate_size > 0 "
                f"({self.moe_intermediate_size}) and decoder_sparse_step > 0 "
                f"({self.decoder_sparse_step})"
            )

        if self.layer_types:
            self._check_hybrid()

    def _check_hybrid(self) -> None:
        kinds = set(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers or not kinds <= set(LAYER_TYPES):
            raise ConfigError(
                f"layer_types must name one of {LAYER_TYPES} for each of the "
                f"{self.num_hidden_layers} layers, got {list(self.layer_types)}"
            )
        if "linear_attention" not in kinds:
            return
        nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
        dims = (self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel_dim)
        if min(nk, nv, *dims) <= 0 or nv % nk:
            raise ConfigError(
                f"Gated DeltaNet layers need positive linear_* heads and dims with value heads "
                f"({nv}) a multiple of key heads ({nk}), got dims {dims}"
            )

    # ---- hybrid layers (Qwen3.5) --------------------------------------------------------
    @property
    def hybrid(self) -> bool:
        """Whether this is a Qwen3.5-family model (model/qwen3_5.py), not a Qwen3."""
        return bool(self.layer_types)

    def is_linear_layer(self, i: int) -> bool:
        """Whether decoder layer i is a Gated DeltaNet layer (else attention)."""
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    @property
    def linear_layers(self) -> int:
        return sum(self.is_linear_layer(i) for i in range(self.num_hidden_layers))

    @property
    def attention_layers(self) -> int:
        """Layers that run softmax attention (all of a Qwen3's)."""
        return self.num_hidden_layers - self.linear_layers

    @property
    def rotary_dim(self) -> int:
        """Dimensions of a head that RoPE turns: all for Qwen3, 64 of 256 for Qwen3.5."""
        return int(self.head_dim * self.partial_rotary_factor)

    def gdn_layer_params(self) -> int:
        """Parameters of one Gated DeltaNet block (in_proj_qkv/z/b/a, conv, A_log, dt_bias,
        gated norm, out_proj), as transformers' Qwen3_5GatedDeltaNet holds them."""
        h, nv = self.hidden_size, self.linear_num_value_heads
        kd = self.linear_num_key_heads * self.linear_key_head_dim
        vd = nv * self.linear_value_head_dim
        conv = 2 * kd + vd
        return (
            h * (conv + vd + 2 * nv)
            + conv * self.linear_conv_kernel_dim
            + 2 * nv
            + (self.linear_value_head_dim + vd * h)
        )

    # ---- mixture of experts -------------------------------------------------------------
    def is_sparse_layer(self, i: int) -> bool:
        """Whether decoder layer i holds experts (transformers' Qwen3MoeDecoderLayer's rule)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def sparse_layers(self) -> int:
        return sum(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_params(self) -> int:
        """Parameter count (lm_head counted once when tied)."""
        h, hd = self.hidden_size, self.head_dim
        q_heads = self.num_attention_heads * (2 if self.attn_output_gate else 1)  # gate beside q
        attn = h * hd * (q_heads + self.num_attention_heads + 2 * self.num_key_value_heads)
        attn += 2 * hd
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        sparse = self.sparse_layers * (self.moe_layer_params() - mlp)  # experts instead of an MLP
        linear = self.linear_layers * (self.gdn_layer_params() - attn)  # a delta rule instead
        return (
            (emb * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + h)
            + sparse
            + linear
        )

    def moe_layer_params(self, experts: int | None = None) -> int:
        """Parameters of one sparse block: the router and `experts` experts (all by default)."""
        experts = self.num_experts if experts is None else experts
        h = self.hidden_size
        shared = self.shared_expert_intermediate_size
        shared_params = 3 * h * shared + h if shared else 0  # its SwiGLU and its gate [1, h]
        return h * self.num_experts + experts * 3 * h * self.moe_intermediate_size + shared_params

    # ---- presets ------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> Qwen3Config:
        if name not in PRESETS:
            raise ValueError(
                f"unknown Qwen3 preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            )
        return PRESETS[name]

    @property
    def native_context(self) -> int:
        """The context the model was trained at, which YaRN stretches: YaRN's original length if
        set; 32,768 for a Qwen3 whose config says 40,960 (its model card's native context, plus
        8,192 of room for generation); else max_position_embeddings (Qwen3.5's 262,144, Qwen3-
        4B-2507's 262,144)."""
        if self.yarn is not None:
            return self.yarn.original_max_position_embeddings
        if not self.hybrid and self.max_position_embeddings == 40960:
            return 32768
        return self.max_position_embeddings

    def yarn_to(self, length: int) -> Qwen3Config:
        """The model with YaRN from its native context to `length` tokens (x32 for Qwen3-8B at
        1,048,576, x4 for Qwen3.5); unchanged if `length` is within the native context."""
        native = self.native_context
        if length <= native:
            return self
        return self.with_yarn(length / native, native)

    def with_yarn(self, factor: float, original_max_position_embeddings: int, **kw) -> Qwen3Config:
        """The same model with YaRN RoPE scaling; max positions become factor x original."""
        if not (1 <= factor < math.inf) or int(original_max_position_embeddings) < 1:
            raise ConfigError(
                f"YaRN needs factor >= 1 and original_max_position_embeddings >= 1, got {factor} "
                f"and {original_max_position_embeddings}"
            )
        yarn = YarnScaling(float(factor), int(original_max_position_embeddings), **kw)
        return replace(
            self, yarn=yarn, max_position_embeddings=int(factor * original_max_position_embeddings)
        )

    # ---- Hugging Face config.json in and out ----------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict[str, Any]) -> Qwen3Config:
        """Read a Hugging Face Qwen3 config: a model directory, a config.json path, or its dict.

        Accepts both RoPE layouts: the older `rope_theta` + `rope_scaling` and the newer
        `rope_parameters` (which holds rope_theta, rope_type and the YaRN fields).
        """
        if isinstance(path_or_dict, dict):
            d, where = dict(path_or_dict), "the given dict"
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.isfile(p):
                raise FileNotFoundError(
                    f"no Hugging Face config at {p!r}: pass a model directory holding config.json "
                    f"(for example a local copy of Qwen/Qwen3-8B) or a preset name "
                    f"({', '.join(sorted(PRESETS))})"
                )
            try:
                with open(p) as f:
                    d, where = json.load(f), p
            except ValueError as e:  # JSONDecodeError, or bytes that are not text
                raise ConfigError(
                    f"{p} is not valid JSON ({e}); restore it from the model's original files"
                ) from None
            if not isinstance(d, dict):
                raise ConfigError(
                    f"{p} holds a JSON {type(d).__name__}, not an object; "
                    f"restore the model's config.json"
                )
        d = _text_fields(d)
        _refuse_unsupported(d, where)
        try:
            return cls._from_dict(d, where)
        except ConfigError as e:  # __post_init__'s refusals do not know the file
            raise (e if where in str(e) else ConfigError(f"{where}: {e}")) from None
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # a field of the wrong type
            raise ConfigError(
                f"{where}: cannot read it as a Qwen3 config ({type(e).__name__}: {e})"
            ) from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any], where: str) -> Qwen3Config:

        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        if rope and not isinstance(next(iter(rope.values())), (int, float, str, bool, type(None))):
            raise ConfigError(f"{where}: per-layer-type rope_parameters are not supported")
        theta = rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))
        rs = {**scaling, **{k: v for k, v in rope.items() if k != "rope_theta"}}
        rope_type = rs.get("rope_type", rs.get("type", "default")) or "default"
        yarn = None
        if rope_type == "yarn":
            if "factor" not in rs or "original_max_position_embeddings" not in rs:
                raise ConfigError(
                    f"{where}: YaRN rope scaling needs 'factor' and "
                    f"'original_max_position_embeddings'"
                )
            if rs.get("mscale") or rs.get("mscale_all_dim"):
                raise ConfigError(
                    f"{where}: YaRN with mscale/mscale_all_dim (DeepSeek style) is not supported"
                )
            yarn = YarnScaling(
                factor=float(rs["factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                beta_fast=float(rs.get("beta_fast") or 32.0),
                beta_slow=float(rs.get("beta_slow") or 1.0),
                attention_factor=(
                    None if rs.get("attention_factor") is None else float(rs["attention_factor"])
                ),
                truncate=bool(rs.get("truncate", True)),
            )
        elif rope_type != "default":
            raise ConfigError(
                f"{where}: RoPE type {rope_type!r} is not supported (only 'default' and 'yarn')"
            )

        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        # a Qwen3.5 MoE has no dense MLP: its (unused) size is the experts'
        intermediate = d.get("intermediate_size") or d.get("moe_intermediate_size")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(intermediate),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            yarn=yarn,
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            initializer_range=float(d.get("initializer_range", 0.02)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=_first(d.get("eos_token_id")),
            **_moe_fields(d),
            **_hybrid_fields(d, rs),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict in the older layout (rope_theta + rope_scaling), which transformers
        releases both before and after the `rope_parameters` change read."""
        d: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "bfloat16",
        }
        if self.num_experts:
            d.update(
                architectures=["Qwen3MoeForCausalLM"],
                model_type="qwen3_moe",
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
                output_router_logits=False,
            )
        if self.hybrid:
            d.update(self._hybrid_hf())
        if self.hybrid and self.num_experts:
            d.update(
                architectures=["Qwen3_5MoeForCausalLM"],
                model_type="qwen3_5_moe_text",
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            )
            for key in ("norm_topk_prob", "decoder_sparse_step", "output_router_logits"):
                d.pop(key, None)  # not Qwen3.5 MoE fields: every layer sparse, always renormalised
        if self.yarn is not None:
            y = asdict(self.yarn)
            d["rope_scaling"] = {
                "rope_type": "yarn",
                **{k: v for k, v in y.items() if v is not None},
            }
        return d

    def _hybrid_hf(self) -> dict[str, Any]:
        """The fields a Qwen3.5 text config.json adds (transformers' Qwen3_5TextConfig, read by
        Qwen3_5ForCausalLM); RoPE in the rope_parameters layout it expects."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "layer_types": list(self.layer_types),
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "attn_output_gate": self.attn_output_gate,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first(x):
    return x[0] if isinstance(x, list) and x else x


def _moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe config.json (transformers 5 writes the
    number of experts as num_local_experts), transformers' defaults where absent; a Qwen3.5
    MoE's too: every layer sparse, the chosen experts always renormalised, a shared expert."""
    if d.get("model_type") == "qwen3_5_moe_text":
        return dict(
            num_experts=int(d.get("num_experts", 256)),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 512)),
            norm_topk_prob=True,  # transformers' Qwen3_5MoeTopKRouter renormalises always
            mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
            router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 512)),
        )
    if d.get("model_type") != "qwen3_moe":
        return {}
    return dict(
        num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
    )


def _text_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Qwen3.5 config.json's text model: text_config's fields, with the outer
    tie_word_embeddings (real checkpoints write it there) and model_type named as the text one."""
    text = d.get("text_config")
    if d.get("model_type") not in MULTIMODAL or not isinstance(text, dict):
        return d
    out = {**text, "model_type": MULTIMODAL[d["model_type"]], "architectures": []}
    if "tie_word_embeddings" in d and "tie_word_embeddings" not in text:
        out["tie_word_embeddings"] = d["tie_word_embeddings"]
    return out


def _hybrid_fields(d: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3.5 text config's layer kinds and Gated DeltaNet fields; {} for a Qwen3. Layer i is
    full attention every full_attention_interval layers (the 4th, 8th, ...) unless layer_types
    lists the kinds."""
    if d.get("model_type") not in HYBRID:
        return {}
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        every = int(d.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    return dict(
        layer_types=tuple(str(t) for t in types),
        linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(d.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
        partial_rotary_factor=float(factor),
        attn_output_gate=bool(d.get("attn_output_gate", True)),
    )


KNOWN = {  # model_type: class
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text")  # text model types of the Qwen3.5 family
MOE = ("qwen3_moe", "qwen3_5_moe_text")  # ... and those with experts
# a checkpoint's outer model_type: its text model's
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
NOT_YET = {  # model types refused by name, with what to use instead
    "qwen3_next": "Qwen3-Next (its own hybrid layers and 512 experts) is not supported yet",
}


def _refuse_unsupported(d: dict[str, Any], where: str) -> None:
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    if model_type in NOT_YET:
        raise ConfigError(
            f"{where}: model_type={model_type!r}: {NOT_YET[model_type]}; Qwen3, Qwen3-MoE, "
            f"Qwen3.5 and Qwen3.6 (dense and MoE) run"
        )
    arch = KNOWN.get(model_type or "qwen3")
    if arch is None or any(a != arch for a in archs):
        raise ConfigError(
            f"{where}: model_type={model_type!r}, architectures={archs} is not a Qwen3 or a "
            f"Qwen3.5 (model_type {', '.join(repr(t) for t in [*KNOWN, *MULTIMODAL])}); this "
            f"trainer runs models such as Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B, Qwen/Qwen3.5-9B"
        )
    if model_type in MOE and not (d.get("num_experts") or d.get("num_local_experts")):
        raise ConfigError(f"{where}: a {model_type} config without num_experts")
    if model_type not in MOE and (d.get("num_experts") or d.get("num_local_experts")):
        raise ConfigError(
            f"{where}: experts in a config whose model_type is not 'qwen3_moe'; "
            f"mixture-of-experts models other than Qwen3-MoE are not supported"
        )
    if d.get("use_sliding_window"):
        raise ConfigError(
            f"{where}: sliding-window attention (use_sliding_window=true) is not supported"
        )
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={d['hidden_act']!r} is not supported (SiLU only)")
    if d.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not supported (Qwen3 has none)")
    missing = [
        k
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size" if model_type != "qwen3_5_moe_text" else "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        if k not in d
    ]
    if missing:
        raise ConfigError(f"{where}: config is missing {missing}")


def _every_fourth_full(n: int) -> tuple[str, ...]:
    """Qwen3.5's layer kinds: full attention every 4th layer, Gated DeltaNet in between."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))


def _qwen3_5(hidden: int, mlp: int, layers: int, heads: int, value_heads: int) -> Qwen3Config:
    """A real Qwen3.5's text model: what every one shares (its config.json files: 16 key heads
    of the delta rule, heads of 256 with RoPE on 64, 4 kv heads, 262,144 positions) and its size."""
    return Qwen3Config(
        vocab_size=248320,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=4,
        head_dim=256,
        rope_theta=10_000_000.0,
        max_position_embeddings=262144,
        bos_token_id=None,
        eos_token_id=248044,
        layer_types=_every_fourth_full(layers),
        linear_num_key_heads=16,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
        attn_output_gate=True,
    )


PRESETS: dict[str, Qwen3Config] = {
    # Shapes as published in the Qwen/Qwen3-* config.json files.
    "qwen3-0.6b": Qwen3Config(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": Qwen3Config(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": Qwen3Config(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": Qwen3Config(),
    "qwen3-14b": Qwen3Config(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
    ),
    "qwen3-32b": Qwen3Config(
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    # Qwen/Qwen3-30B-A3B: 48 layers, each with 128 experts of 768, 8 per token (model/moe.py).
    "qwen3-30b-a3b": Qwen3Config(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # Qwen/Qwen3.5-9B and Qwen/Qwen3.5-27B's text models: 3 Gated DeltaNet layers to 1 gated
    # attention layer (16 or 24 heads of 256, RoPE on 64 of them), 262,144 native positions.
    "qwen3.5-9b": _qwen3_5(hidden=4096, mlp=12288, layers=32, heads=16, value_heads=32),
    "qwen3.5-27b": _qwen3_5(hidden=5120, mlp=17408, layers=64, heads=24, value_heads=48),
    # Qwen/Qwen3.5-35B-A3B's text model (Qwen/Qwen3.6-35B-A3B's has the same shapes): 40 layers,
    # each sparse, 256 experts of 512 (8 per token) and a gated shared expert of 512.
    "qwen3.5-35b-a3b": replace(
        _qwen3_5(hidden=2048, mlp=512, layers=40, heads=16, value_heads=32),
        num_key_value_heads=2,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        norm_topk_prob=True,
        shared_expert_intermediate_size=512,
    ),
    # For tests: 3 Gated DeltaNet layers and 1 attention layer, 4 key heads of the delta rule
    # to 8 value heads, RoPE on 8 of 32 dimensions, tied embeddings.
    "qwen3.5-tiny": Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        layer_types=_every_fourth_full(4),
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
        attn_output_gate=True,
    ),
    # For tests and the CPU demo: head_dim deliberately not hidden / heads, GQA ratio 2.
    "tiny": Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
    ),
    # The CPU demo (train.py --preset demo): 64 tokens, so a row's first half is random and its
    # second half predictable; 2 layers are enough to learn to copy across the sp shards.
    "demo": Qwen3Config(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
    ),
}

# For tests: qwen3.5-tiny with every layer sparse, 8 experts of 32 (the top 2 chosen) and a
# shared expert of 48, untied as the real Qwen3.5 MoE models are.
PRESETS["qwen3.5-moe-tiny"] = replace(
    PRESETS["qwen3.5-tiny"],
    tie_word_embeddings=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    shared_expert_intermediate_size=48,
)


def load_config(name_or_path: str) -> Qwen3Config:
    """A preset name, or a config.json / model directory read with Qwen3Config.from_hf."""
    if name_or_path in PRESETS:
        return Qwen3Config.preset(name_or_path)
    return Qwen3Config.from_hf(name_or_path)
