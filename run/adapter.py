"""The trainer's side of LoRA (model/lora.py): the --lora-* flags, their checks, OUT/final.

    spec = lora_spec(cfg)            # a LoraSpec, or None for full fine-tuning (--lora-rank 0)
    check_lora(cfg, mc)              # run/checks.py: a bad combination is one line and exit 2
    export_lora(model, cfg, spec, final, dtype=torch.bfloat16, tokenizer_dir=model_dir)

The flags name the layers briefly: --lora-targets q,k,v,o,gate,up,down (the decoder's linear
layers, q_proj ... down_proj; a Qwen3.5's Gated DeltaNet layers add qkv,z,b,a,out: in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a, out_proj, PEFT's names for them) and --lora-train
embed,norm,head (whole tensors that train too, PEFT's modules_to_save: the embedding, every
RMSNorm, the output head). --lora-from DIR reads a
PEFT adapter directory (this trainer's OUT/final or PEFT's save_pretrained): its
adapter_config.json gives the rank, alpha, targets and trained tensors, and its values replace the
initial adapters. OUT/final is PEFT's adapter directory, or with --lora-merge the merged model in
the Hugging Face layout (W + scale * B @ A), which transformers loads alone.
"""

from __future__ import annotations

import json
import os

from model.config import ConfigError
from model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSpec, read_adapter_config

TARGETS = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
    # Qwen3.5's Gated DeltaNet layers (model/qwen3_5.py); a Qwen3 has none of them
    "qkv": "in_proj_qkv",
    "z": "in_proj_z",
    "b": "in_proj_b",
    "a": "in_proj_a",
    "out": "out_proj",
}
DEFAULT_TARGETS = ",".join(TARGETS)  # --lora-targets' default: every linear layer of a decoder
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
TRAIN = {"embed": "embed_tokens", "norm": "norm", "head": "lm_head"}


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def lora_spec(cfg) -> LoraSpec | None:
    """The run's LoraSpec: --lora-from's adapter_config.json, else the flags; None when neither
    asks for LoRA (full fine-tuning)."""
    if getattr(cfg, "lora_from", ""):
        return read_adapter_config(cfg.lora_from)
    if getattr(cfg, "lora_rank", 0) <= 0:
        return None
    return LoraSpec(
        rank=cfg.lora_rank,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        targets=tuple(TARGETS[t] for t in _names(cfg.lora_targets)),
        train=tuple(TRAIN[t] for t in _names(cfg.lora_train)),
        rslora=cfg.lora_rslora,
    )


def check_lora(cfg, mc=None) -> None:
    """Refuse, in one line, LoRA flags that cannot work together (before any weight is read)."""
    targets, train = _names(cfg.lora_targets), _names(cfg.lora_train)
    if bad := [t for t in targets if t not in TARGETS] or (not targets and ["(none)"]):
        raise ConfigError(
            f"--lora-targets {cfg.lora_targets}: {', '.join(bad)} is not one of "
            f"{', '.join(TARGETS)} (comma-separated)"
        )
    if bad := [t for t in train if t not in TRAIN]:
        raise ConfigError(
            f"--lora-train {cfg.lora_train}: {', '.join(bad)} is not one of {', '.join(TRAIN)}"
        )
    if cfg.lora_from:
        check_adapter_dir(cfg.lora_from)
        saved = read_adapter_config(cfg.lora_from).rank
        if cfg.lora_rank not in (0, saved):
            raise ConfigError(
                f"--lora-rank {cfg.lora_rank}: --lora-from {cfg.lora_from} holds rank {saved}; "
                f"drop --lora-rank (the adapter's config decides)"
            )
    spec = lora_spec(cfg)
    if spec is None:
        if cfg.lora_merge:
            raise ConfigError("--lora-merge merges an adapter: add --lora-rank R or --lora-from")
        return
    if cfg.cpu_offload:
        raise ConfigError(
            "--cpu-offload with LoRA buys nothing: the frozen weights have no fp32 copy, "
            "gradient or AdamW state to move; drop --cpu-offload"
        )
    if mc is not None and mc.num_experts:
        check_moe_targets(cfg, mc, spec)
    tied = mc is not None and mc.tie_word_embeddings
    if tied and {"embed_tokens", "lm_head"} & set(spec.train):
        raise ConfigError(
            "--lora-train embed/head: this model ties its embedding and output head (one "
            "tensor), which PEFT's adapter files cannot hold; train norm only"
        )


def _dense_layers(mc) -> int:
    return mc.num_hidden_layers - mc.sparse_layers


def check_moe_targets(cfg, mc, spec: LoraSpec) -> None:
    """A mixture of experts: the experts (stacked tensors) and the router take no adapters, so
    gate/up/down adapt only the dense layers' MLPs (and a Qwen3.5 MoE's shared experts). Named
    on a model without one, or when nothing else is targeted, they are refused; the default
    targets just pass them over."""
    mlp = [t for t in spec.targets if t in MLP_TARGETS]
    if not mlp or _dense_layers(mc) or mc.shared_expert_intermediate_size:
        return  # a dense MLP, or a Qwen3.5 MoE's shared expert, takes them
    typed = not cfg.lora_from and cfg.lora_targets != DEFAULT_TARGETS
    if typed or len(mlp) == len(spec.targets):
        names = ",".join(k for k, v in TARGETS.items() if v in mlp)
        raise ConfigError(
            f"--lora-targets {names}: every MLP of this model is a mixture of experts, whose "
            f"experts and router take no adapters; target q,k,v,o"
        )


def lora_note(cfg, mc) -> str | None:
    """The line a LoRA run on a mixture of experts starts with: what is adapted, and that the
    experts are not. None for full fine-tuning and dense models."""
    spec = lora_spec(cfg)
    if spec is None or not mc.num_experts:
        return None
    absent = MLP_TARGETS if mc.hybrid else MLP_TARGETS + LINEAR_ATTENTION_TARGETS
    attention = [k for k, v in TARGETS.items() if v in spec.targets and v not in absent]
    mlp = [k for k, v in TARGETS.items() if v in spec.targets and v in MLP_TARGETS]
    dense = _dense_layers(mc)
    where = [f"{','.join(attention)} in every layer"] if attention else []
    if mlp and dense:
        where.append(f"{','.join(mlp)} in the {dense} dense layer{'s' * (dense > 1)}")
    if mlp and mc.shared_expert_intermediate_size:
        where.append(f"{','.join(mlp)} in every layer's shared expert")
    return (
        f"LoRA: adapters on {' and '.join(where)}; the experts and the router of the "
        f"{mc.sparse_layers} mixture-of-experts layers are not adapted (frozen)"
    )


def check_adapter_dir(path: str) -> None:
    """A PEFT LoRA adapter directory, or one line saying what is missing."""
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(path, name)):
            raise ConfigError(
                f"--lora-from {path}: no {name} there; pass a directory a LoRA run wrote "
                f"(OUT/final) or PEFT's save_pretrained"
            )
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            kind = json.load(f).get("peft_type")
    except (OSError, ValueError) as e:
        raise ConfigError(f"--lora-from {path}: cannot read {ADAPTER_CONFIG} ({e})") from None
    if kind != "LORA":
        raise ConfigError(f"--lora-from {path}: a {kind} adapter, not LoRA")


def export_lora(model, cfg, spec: LoraSpec, path: str, *, dtype, tokenizer_dir, progress):
    """OUT/final of a LoRA run: PEFT's adapter directory (the trainable tensors in `dtype`), or
    with --lora-merge the merged model in the Hugging Face layout. Collective."""
    import torch.distributed as dist

    from model.lora import merge_lora_sharded, save_adapter
    from run.export import export_final

    if cfg.lora_merge:
        merge_lora_sharded(model)  # the base weights now hold W + scale * B @ A
        return export_final(
            model,
            path,
            dtype=dtype,
            tokenizer_dir=tokenizer_dir,
            progress=progress,
            base_only=True,
            source_dir=tokenizer_dir,  # the model directory: a multimodal layout is kept
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    base = cfg.model if not os.path.isdir(cfg.model) else os.path.abspath(cfg.model)
    save_adapter(model, spec, path, dtype=dtype, base_model=base, write=rank == 0)
    if dist.is_initialized():
        dist.barrier()
    return path
