"""LoRA (model/lora.py) against PEFT's LoraModel on transformers' Qwen3ForCausalLM.

Both sides get the same base weights and the same adapter values (B non-zero, so the adapters
change the output); logits, the adapters' and the trained norms' gradients must agree in fp32,
plain, with the tiled MLP and under checkpoint-with-offload, and no frozen weight may get a
gradient. The adapter directory this file's save_adapter writes is loaded by PEFT itself.
"""

import os

import peft
import pytest
import torch
import torch.nn.functional as F
from hf_ref import hf_model, save_hf

from model.checkpoint_offload import apply_offload
from model.config import Qwen3Config
from model.lora import LoraLinear, LoraSpec, add_lora, init_lora, merge_lora, save_adapter
from model.qwen3 import Qwen3
from model.tiled_mlp import set_mlp_tiling
from model.weights import load_safetensors

CFG = Qwen3Config.preset("tiny")
T = 40


def _peft_pair(spec: LoraSpec, tmp_path, seed=0):
    """(ours, PEFT's): the same base and the same random adapters (B non-zero)."""
    ref = hf_model(CFG, seed=seed)
    save_hf(ref, str(tmp_path))
    ours = Qwen3(CFG)
    load_safetensors(ours, str(tmp_path), progress=False)
    add_lora(ours, spec)
    init_lora(ours, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, LoraLinear):  # B starts at zero: give it values that show
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
    lc = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.targets),
        modules_to_save=list(spec.train) or None,
        use_rslora=spec.rslora,
    )
    theirs = peft.get_peft_model(ref, lc)
    state = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
             for k, v in ours.state_dict().items() if "lora_" in k}  # fmt: skip
    missing = [k for k in state if "base_model.model." + k not in theirs.state_dict()]
    assert not missing, missing[:3]
    theirs.load_state_dict({"base_model.model." + k: v for k, v in state.items()}, strict=False)
    return ours, theirs


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _adapter_grads(model, prefix=""):
    return {
        n.removeprefix(prefix).replace(".default", "").replace(".modules_to_save", ""): p.grad
        for n, p in model.named_parameters()
        if p.requires_grad
    }


@pytest.mark.parametrize(
    "case",
    ["plain", "rslora-train-norm", "tiled", "offload-tiled"],
)
def test_logits_and_grads_match_peft(case, tmp_path):
    spec = LoraSpec(rank=4, alpha=12.0)
    if case == "rslora-train-norm":
        spec = LoraSpec(rank=4, alpha=12.0, rslora=True, train=("norm", "embed_tokens"))
    ours, theirs = _peft_pair(spec, tmp_path)
    if case == "tiled":
        for layer in ours.model.layers:
            set_mlp_tiling(layer.mlp, 16)  # ragged: 40 tokens over tiles of 16
    if case == "offload-tiled":
        apply_offload(ours, min_bytes=0, tile_mlp=16, save_attention=True)
    ids = torch.randint(0, CFG.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    theirs.train()
    ours.train()
    mine, ref = ours.logits(ids), theirs(ids).logits
    diff = (mine - ref).abs().max().item()
    _loss(mine, ids).backward()
    _loss(ref, ids).backward()
    got, want = _adapter_grads(ours), _adapter_grads(theirs, "base_model.model.")
    assert sorted(got) == sorted(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    scale = max(want[k].abs().max().item() for k in want)
    print(f"{case}: logits {diff:.2e}, adapter grads {worst:.2e} (largest {scale:.2e})")
    assert diff <= 1e-5
    assert worst <= 1e-5
    frozen = [n for n, p in ours.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in ours.parameters() if not p.requires_grad)
    n_adapters = sum(1 for m in ours.modules() if isinstance(m, LoraLinear))
    assert n_adapters == 7 * CFG.num_hidden_layers


def test_dropout_masks_replay_in_tiles_and_recompute(tmp_path):
    """Adapter dropout 0.3: one tile covering every token draws the masks LoraLinear draws, so a
    tiled MLP under checkpoint-with-offload (its recompute and its tiles' backward replaying the
    masks) gives the plain model's logits and gradients; a wrong replay would not."""
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.3)
    ours, _ = _peft_pair(spec, tmp_path)
    ids = torch.randint(0, CFG.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    results = []
    for wrapped in (False, True):
        if wrapped:
            apply_offload(ours, min_bytes=0, tile_mlp=2 * T, preserve_rng_state=True)
        ours.zero_grad()
        torch.manual_seed(5)
        logits = ours.logits(ids)
        _loss(logits, ids).backward()
        results.append((logits.detach(), _adapter_grads(ours)))
    (plain, g_plain), (tiled, g_tiled) = results
    assert (plain - tiled).abs().max().item() <= 1e-6
    assert max((g_plain[k] - g_tiled[k]).abs().max().item() for k in g_plain) <= 1e-6


def test_saved_adapter_loads_in_peft_and_merge_equals_it(tmp_path):
    """save_adapter's directory through peft.PeftModel.from_pretrained gives our logits; the
    merged model (merge_lora) gives them too."""
    spec = LoraSpec(rank=4, alpha=12.0, train=("norm",))
    ours, _ = _peft_pair(spec, tmp_path / "base")
    ours.eval()
    ids = torch.randint(0, CFG.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    save_adapter(ours, spec, str(tmp_path / "adapter"))
    assert sorted(os.listdir(tmp_path / "adapter")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = hf_model(CFG, seed=0)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        mine = ours.logits(ids)
        diff = (mine - loaded(ids).logits).abs().max().item()
        merge_lora(ours)
        merged = (ours.logits(ids) - mine).abs().max().item()
    print(f"PEFT-loaded adapter: {diff:.2e}; merged: {merged:.2e}")
    assert diff <= 1e-5 and merged <= 1e-5
    assert not any(isinstance(m, LoraLinear) for m in ours.modules())
    assert all("lora_" not in k for k in ours.state_dict())
