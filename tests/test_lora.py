"""LoRA (model/lora.py) against PEFT's LoraModel on transformers' Qwen3ForCausalLM.

Both sides get the same base weights and the same adapter values (B non-zero, so the adapters
change the output); logits, the adapters' and the trained norms' gradients must agree in fp32,
plain, with the tiled MLP and under checkpoint-with-offload, and no frozen weight may get a
gradient. The adapter directory this file's save_adapter writes is loaded by PEFT itself.
"""

import os
from dataclasses import replace

import peft
import pytest
import torch
import torch.nn.functional as F
from hf_ref import hf_model, save_hf

from model.checkpoint_offload import apply_offload
from model.config import Qwen3Config
from model.lora import (
    LoraLinear,
    LoraSpec,
    add_lora,
    init_lora,
    merge_lora,
    save_adapter,
)
from model.qwen3 import Qwen3
from model.tiled_mlp import set_mlp_tiling
from model.weights import load_safetensors

CFG = Qwen3Config.preset("tiny")
T = 40


def _peft_pair(spec: LoraSpec, tmp_path, seed=0, cfg=CFG, peft_targets=None):
    """(ours, PEFT's): the same base and the same random adapters (B non-zero); PEFT given
    spec's targets, or peft_targets."""
    ref = hf_model(cfg, seed=seed)
    save_hf(ref, str(tmp_path))
    ours = Qwen3(cfg)
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
        target_modules=list(peft_targets or spec.targets),
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


@pytest.mark.parametrize("case", ["dense-layer-1", "all-sparse"])
def test_moe_attention_adapters_match_peft_and_its_adapter_file(case, tmp_path):
    """A mixture of experts against PEFT on transformers' Qwen3MoeForCausalLM, adapters on
    q,k,v,o: equal logits and adapter gradients, router and experts frozen. Our router is an
    nn.Linear named gate, so the "gate" target is added on our side: adapted, it would show as
    an adapter PEFT lacks. (PEFT 0.21 takes gate_proj/up_proj/down_proj on this model for the
    experts' stacked tensors, so a dense layer's MLP adapters have no PEFT reference here.)
    The adapter directory save_adapter writes loads in PEFT with our logits."""
    from test_moe import MOE

    from model.moe import SparseMoeBlock

    cfg = MOE if case == "dense-layer-1" else replace(MOE, mlp_only_layers=())
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    spec = LoraSpec(rank=4, alpha=12.0, targets=(*attention, "gate"))
    ours, theirs = _peft_pair(spec, tmp_path, cfg=cfg, peft_targets=attention)
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    theirs.train()
    ours.train()
    mine, ref = ours.logits(ids), theirs(ids).logits
    diff = (mine - ref).abs().max().item()
    _loss(mine, ids).backward()
    _loss(ref, ids).backward()
    got, want = _adapter_grads(ours), _adapter_grads(theirs, "base_model.model.")
    assert sorted(got) == sorted(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"{case}: logits {diff:.2e}, adapter grads {worst:.2e}")
    assert diff <= 1e-5 and worst <= 1e-5
    blocks = [m for m in ours.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == cfg.sparse_layers
    for block in blocks:
        assert not isinstance(block.gate, LoraLinear)
        assert all(not p.requires_grad and p.grad is None for p in block.parameters())
    if case == "all-sparse":  # Qwen3-30B-A3B's shape: the file PEFT loads is exact
        ours.eval()  # saved under the default targets, gate_proj/up_proj/down_proj among them
        save_adapter(ours, LoraSpec(rank=4, alpha=12.0), str(tmp_path / "adapter"))
        base = hf_model(cfg, seed=0)
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        assert not [n for n, _ in loaded.named_parameters() if "experts" in n and "lora" in n]
        with torch.no_grad():
            assert (ours.logits(ids) - loaded(ids).logits).abs().max().item() <= 1e-5


def test_moe_default_targets_adapt_attention_and_dense_mlps(tmp_path):
    """The default targets on a mixture of experts with one dense layer: adapters on every
    attention projection and on the dense layer's three MLP linears, nothing on the experts or
    the router, which get no gradient; the planner counts the trainable elements it holds."""
    from test_moe import MOE

    from memory.model_size import fsdp_units
    from model.moe import SparseMoeBlock

    model = Qwen3(MOE)
    spec = LoraSpec(rank=4)
    add_lora(model, spec)
    adapted = sorted(n for n, m in model.named_modules() if isinstance(m, LoraLinear))
    dense = [i for i in range(MOE.num_hidden_layers) if not MOE.is_sparse_layer(i)]
    assert dense == [1]
    assert len(adapted) == 4 * MOE.num_hidden_layers + 3 * len(dense)
    assert [n for n in adapted if ".mlp." in n] == [
        f"model.layers.1.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")
    ]
    init_lora(model)
    ids = torch.randint(0, MOE.vocab_size, (1, T), generator=torch.Generator().manual_seed(4))
    _loss(model.logits(ids), ids).backward()
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        assert all(not p.requires_grad and p.grad is None for p in block.parameters())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert fsdp_units(MOE, 1, 4, spec).trainable_shards == 4 * trainable


def test_moe_lora_flags_refused_and_said(tmp_path):
    """On a model whose every MLP is a mixture of experts, --lora-targets naming gate/up/down
    is one line; the default targets pass and the run's first lines say what is adapted."""
    from test_moe import MOE

    import train
    from model.config import ConfigError
    from run.adapter import check_lora, lora_note

    sparse = replace(MOE, mlp_only_layers=())
    default = train.parse_args(["--lora-rank", "4"])
    check_lora(default, sparse)
    assert lora_note(default, sparse) == (
        "LoRA: adapters on q,k,v,o in every layer; the experts and the router of the 3 "
        "mixture-of-experts layers are not adapted (frozen)"
    )
    assert lora_note(default, MOE).startswith(
        "LoRA: adapters on q,k,v,o in every layer and gate,up,down in the 1 dense layer;"
    )
    assert lora_note(default, CFG) is None
    for targets in ("q,gate", "up,down"):
        cfg = train.parse_args(["--lora-rank", "4", "--lora-targets", targets])
        check_lora(cfg, MOE)  # a dense layer to adapt
        with pytest.raises(ConfigError, match="every MLP of this model is a mixture of experts"):
            check_lora(cfg, sparse)
