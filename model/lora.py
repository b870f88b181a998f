"""LoRA for the linear layers of any model: frozen base weights, small trainable adapters.

To use it elsewhere: copy this file alone; it needs torch only.

    spec = LoraSpec(rank=16, alpha=32, targets=("q_proj", "v_proj"), train=("norm",))
    add_lora(model, spec, base_dtype=torch.bfloat16)   # in place: adapters in, the rest frozen
    init_lora(model, seed=0)                 # A Kaiming-uniform, B zero (PEFT's), sharded or not
    opt = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    save_adapter(model, spec, "out/final")   # adapter_model.safetensors + adapter_config.json
    merge_lora(model)                        # W += scale * B @ A, the adapters gone (for export)

Each targeted nn.Linear becomes a LoraLinear, a subclass of nn.Linear that keeps the same `weight`
(frozen) and adds two fp32 nn.Linear submodules, lora_A [rank, in] and lora_B [out, rank]:

    y = x W^T + scale * B (A dropout(x))      scale = alpha / rank  (rslora: alpha / sqrt(rank))

exactly PEFT's LoraLayer. Parameter names are PEFT's too: `...q_proj.weight` stays the base
weight's name (so a checkpoint loads unchanged) and the adapters are `...q_proj.lora_A.weight`,
`...q_proj.lora_B.weight`, which with PEFT's `base_model.model.` prefix are the keys of its
adapter_model.safetensors. Whole tensors that train too (`train`, PEFT's modules_to_save: every
module whose name ends with one of them, e.g. "norm" is every RMSNorm) keep their names.

Frozen means: requires_grad False and stored in `base_dtype` (the compute dtype), so there is no
fp32 copy, no gradient and no optimizer state, and autograd skips the weight-gradient GEMM of a
frozen linear (only x's gradient is computed through it). The adapters and `train` tensors stay
fp32, the masters the optimizer updates.

Under FSDP2 (fully_shard after add_lora, init_lora after materialising): frozen and trainable
parameters share one unit. torch (2.8 on) asks for one original dtype among a unit's trainable
parameters only, so bf16 frozen weights sit beside fp32 adapters; with a bf16 param_dtype all
are gathered in bf16. Frozen parameters get no gradient and so no reduce-scatter. A tiled MLP
(model/tiled_mlp.py) reads each projection's low_rank() and runs the adapters inside its tiles;
checkpointing needs preserve_rng_state=True only when dropout is on.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_TARGETS",
    "LoraLinear",
    "LoraSpec",
    "add_lora",
    "adapter_state",
    "init_lora",
    "is_adapter_key",
    "load_adapter",
    "merge_lora",
    "merge_lora_sharded",
    "read_adapter_config",
    "save_adapter",
    "trainable_names",
    "trains_whole",
]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's parameter names
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraSpec:
    """What add_lora does: rank and alpha (the scale), dropout on the adapters' input, the
    linear layers it adapts (by the last part of their names) and the whole tensors that train."""

    rank: int
    alpha: float = 8.0  # PEFT's default lora_alpha
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    train: tuple[str, ...] = ()  # modules_to_save: module names ending with one of these
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoraLinear(nn.Linear):
    """An nn.Linear with a LoRA adapter: the base `weight` (and bias) of the linear it replaces,
    lora_A and lora_B (fp32 nn.Linear), `scale`, and dropout on the adapter's input."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # not nn.Linear's: the base's own parameters are reused
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        kw = dict(bias=False, device=base.weight.device, dtype=torch.float32)
        self.lora_A = nn.Linear(self.in_features, rank, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        a = x.to(self.lora_A.weight.dtype)  # bf16 under FSDP2's param_dtype; fp32 otherwise
        delta = self.lora_B(self.lora_A(self.lora_dropout(a))) * self.scale
        return y + delta.to(y.dtype)

    def low_rank(self) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """(A, B, scale, dropout probability while training) for code that runs the projection
        its own way (model/tiled_mlp.py); the weights as they are at call time (gathered)."""
        dropout = self.lora_dropout
        p = dropout.p if self.training and isinstance(dropout, nn.Dropout) else 0.0
        return self.lora_A.weight, self.lora_B.weight, self.scale, float(p)

    def extra_repr(self) -> str:
        rank = self.lora_A.out_features
        return f"{self.in_features}, {self.out_features}, rank={rank}, scale={self.scale:g}"


def trains_whole(name: str, spec: LoraSpec) -> bool:
    """PEFT's modules_to_save rule: the module's name ends with one of spec.train."""
    return any(name.endswith(t) for t in spec.train)


def add_lora(model: nn.Module, spec: LoraSpec, *, base_dtype: torch.dtype | None = None) -> None:
    """Replace every nn.Linear named by spec.targets with a LoraLinear, freeze every other
    parameter except the modules spec.train names, and store the frozen ones in base_dtype
    (None: as they are). Works on a model on the meta device (before FSDP2's fully_shard).
    Only plain nn.Linear modules are adapted, not subclasses of it (a MoE router); as in PEFT,
    a target that names nothing is passed over while another target names something."""
    if spec.rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {spec.rank}")
    if not 0 <= spec.dropout < 1:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {spec.dropout}")
    found = []
    for name, module in list(model.named_modules()):
        last = name.rsplit(".", 1)[-1]
        if type(module) is nn.Linear and last in spec.targets:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, last, LoraLinear(module, spec.rank, spec.scale, spec.dropout))
            found.append(last)
    if not found:  # PEFT's rule: a target may miss (a MoE model's sparse MLPs), not all of them
        raise ValueError(
            f"LoRA targets {sorted(spec.targets)} name no nn.Linear in {type(model).__name__}"
        )
    trained = {
        id(p) for n, m in model.named_modules() if trains_whole(n, spec) for p in m.parameters()
    }
    adapters = {
        id(p)
        for m in model.modules()
        if isinstance(m, LoraLinear)
        for p in (m.lora_A.weight, m.lora_B.weight)
    }
    converted: dict[int, nn.Parameter] = {}  # a tied weight once
    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            if id(p) in adapters:
                continue
            if id(p) in trained:
                p.requires_grad_(True)
                continue
            if id(p) not in converted:
                dtype = base_dtype or p.dtype
                converted[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            setattr(module, pname, converted[id(p)])


def trainable_names(model: nn.Module) -> list[str]:
    """The names of the parameters that train (adapters and whole tensors), as state_dict's."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def init_lora(model: nn.Module, seed: int = 0) -> None:
    """PEFT's initial adapters: A Kaiming-uniform (a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B
    zero, so the model starts as the base. A's values depend on (seed, name) only: each is drawn
    whole on the CPU and this process keeps its shard (FSDP2 DTensors, any world size)."""
    for name, module in model.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        gen = torch.Generator().manual_seed(_name_seed(seed, name))
        full = torch.empty(module.lora_A.weight.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
        _copy_full_(module.lora_A.weight, full)
        module.lora_B.weight.zero_()


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """param (plain or a DTensor shard) <- its part of the full tensor, without communication."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank holds `full` already, so each keeps its own shard
        local = distribute_tensor(
            full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def adapter_state(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{PEFT's saved name: full tensor} of every trainable parameter, on the CPU. Collective for
    FSDP2 models (each tensor gathered in turn); every rank gets the tensors."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[PEFT_PREFIX + name] = full.detach().to(dtype or full.dtype).cpu().contiguous()
    return out


def peft_config(spec: LoraSpec, base_model: str | None = None) -> dict:
    """adapter_config.json's fields for PEFT's LoraConfig (the rest take PEFT's defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "use_rslora": spec.rslora,
        "target_modules": sorted(spec.targets),
        "modules_to_save": list(spec.train) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_adapter(
    model: nn.Module,
    spec: LoraSpec,
    path: str,
    *,
    dtype: torch.dtype | None = None,
    base_model: str | None = None,
    write: bool = True,
) -> None:
    """PEFT's adapter directory: adapter_model.safetensors and adapter_config.json, which
    peft.PeftModel.from_pretrained(base, path) loads. Collective for FSDP2 models: every rank
    calls it, only those with write=True write. target_modules lists the targets that named
    an adapted layer: PEFT takes gate_proj/up_proj/down_proj on a Qwen3 mixture of experts for
    its stacked experts, which have no adapter here."""
    from safetensors.torch import save_file

    tensors = adapter_state(model, dtype=dtype)
    if not write:
        return
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    spec = replace(spec, targets=tuple(t for t in spec.targets if t in adapted))
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, ADAPTER_WEIGHTS + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, ADAPTER_WEIGHTS))
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(spec, base_model), f, indent=2)


def read_adapter_config(path: str) -> LoraSpec:
    """The LoraSpec of a PEFT adapter directory (r, lora_alpha, lora_dropout, use_rslora,
    target_modules, modules_to_save)."""
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        c = json.load(f)
    targets = c.get("target_modules") or DEFAULT_TARGETS
    if isinstance(targets, str):
        raise ValueError(f"{path}: a regular expression as target_modules is not supported")
    return LoraSpec(
        rank=int(c["r"]),
        alpha=float(c.get("lora_alpha", 8)),
        dropout=float(c.get("lora_dropout", 0.0)),
        targets=tuple(targets),
        train=tuple(c.get("modules_to_save") or ()),
        rslora=bool(c.get("use_rslora", False)),
    )


@torch.no_grad()
def load_adapter(model: nn.Module, path: str) -> None:
    """Fill the trainable parameters from a PEFT adapter directory (this file's or PEFT's own
    save_pretrained), each process its own shard. Every trainable tensor must be in the file."""
    from safetensors.torch import load_file

    saved = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    params = dict(model.named_parameters())
    wanted = {PEFT_PREFIX + n: n for n, p in params.items() if p.requires_grad}
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise ValueError(f"adapter {path!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for key, name in wanted.items():
        if tuple(saved[key].shape) != tuple(params[name].shape):
            raise ValueError(
                f"adapter {path!r}: {key} is {tuple(saved[key].shape)}, the model's "
                f"{tuple(params[name].shape)}"
            )
        _copy_full_(params[name], saved[key].float())


def is_adapter_key(name: str) -> bool:
    """Whether a state_dict key is an adapter's (lora_A or lora_B), not the base model's."""
    return ".lora_A." in name or ".lora_B." in name


@torch.no_grad()
def merge_lora_sharded(model: nn.Module) -> None:
    """Fold each adapter into its base weight in place (W += scale * B @ A) and zero B, so the
    model computes the same and its base weights are the merged model. On plain or FSDP2
    models: W [out, in] and B [out, rank] are split by the same rows, A is gathered (small)."""
    for module in model.modules():
        if not isinstance(module, LoraLinear):
            continue
        a = module.lora_A.weight
        a_full = a.full_tensor() if hasattr(a, "full_tensor") else a
        w, b = module.weight, module.lora_B.weight
        w_local = w.to_local() if hasattr(w, "to_local") else w
        b_local = b.to_local() if hasattr(b, "to_local") else b
        delta = (b_local.float() @ a_full.float()) * module.scale
        w_local.copy_((w_local.float() + delta).to(w_local.dtype))
        b_local.zero_()


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold each adapter into its base weight (W += scale * B @ A) and put plain nn.Linear back,
    so state_dict is the base model's layout. On an unsharded model (gather first)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoraLinear):
            continue
        delta = (module.lora_B.weight.float() @ module.lora_A.weight.float()) * module.scale
        plain = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None,
            device=module.weight.device, dtype=module.weight.dtype,
        )  # fmt: skip
        plain.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
        if module.bias is not None:
            plain.bias.copy_(module.bias)
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, name.rsplit(".", 1)[-1], plain)
