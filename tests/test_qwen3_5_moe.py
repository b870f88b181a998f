"""Qwen3.5 MoE (model/qwen3_5.py's SharedExpertMoe on model/moe.py) against transformers'
Qwen3_5MoeForCausalLM: logits and gradients, the first step through train.py on every layout with
and without the router loss, and a released-style checkpoint's export.

The tiny config is tests/test_qwen3_5.py's hybrid (3 Gated DeltaNet layers, 1 attention layer)
with every layer sparse: 8 experts of 32, the top 2 chosen, and a shared expert of 48.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers
from dist_utils import run_train
from safetensors.torch import load_file
from test_moe import _ref_step as reference_step_with_router_loss
from test_qwen3_5 import TINY, gradient_difference, multimodal_checkpoint, text_config
from test_train import _common, metrics

from model.config import Qwen3Config
from model.qwen3_5 import Qwen3_5, SharedExpertMoe
from model.weights import load_safetensors

MOE = replace(Qwen3Config.preset("qwen3.5-moe-tiny"), vocab_size=TINY.vocab_size)
COEF = 0.05  # the router loss's weight in the runs that add it


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Norms, conv filters, decays and step sizes off their initial values; the router and the
    experts drawn wide enough that the routing and every expert's share of a token matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias", "conv1d.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif ".experts." in name or name.endswith(
                ("mlp.gate.weight", "shared_expert_gate.weight")
            ):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def hf_moe(cfg: Qwen3Config, seed: int = 0) -> transformers.Qwen3_5MoeForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen3_5MoeTextConfig(**text_config(cfg))
    ref = transformers.Qwen3_5MoeForCausalLM(config).float().eval()
    perturb(ref, seed)
    return ref


def test_logits_and_gradients_match_transformers(tmp_path):
    ref = hf_moe(MOE)
    ref.save_pretrained(str(tmp_path))
    assert Qwen3Config.from_hf(str(tmp_path)) == MOE
    ours = Qwen3_5(MOE)
    load_safetensors(ours, str(tmp_path), progress=False)  # one tensor per expert, as saved
    assert sum(p.numel() for p in ref.parameters()) == MOE.num_params()
    assert all(isinstance(layer.mlp, SharedExpertMoe) for layer in ours.model.layers)
    ids = torch.randint(0, MOE.vocab_size, (2, 101), generator=torch.Generator().manual_seed(1))
    ref_logits, our_logits = ref(ids[:, :-1]).logits, ours.logits(ids[:, :-1])
    diff = (our_logits - ref_logits).abs().max().item()
    print(f"max |logits - transformers| = {diff:.2e}")
    assert diff <= 1e-5
    worst = gradient_difference(ref, ours, ref_logits, our_logits, ids[:, 1:])
    print(f"max |gradient - transformers| / max |gradient| = {worst:.2e}")
    assert worst <= 1e-5


@pytest.mark.slow
def test_train_first_step_matches_transformers_on_every_layout(tmp_path):
    ref = hf_moe(MOE, seed=3).train()
    ref.save_pretrained(str(tmp_path / "model"))
    rows = np.random.default_rng(0).integers(0, MOE.vocab_size, size=(8, 65), dtype=np.int64)
    np.save(tmp_path / "tokens.npy", rows)
    aux = ["--router-aux-loss", str(COEF)]
    runs = {  # name: (processes, flags, rows per step, router loss coefficient)
        "1proc": (1, ["--sp", "1"], 1, 0.0),
        "1proc-aux": (1, ["--sp", "1", *aux], 1, COEF),
        "sp2-offload-tiled-aux": (2, ["--sp", "2", "--offload", "--tile-mlp", "16", *aux], 1, COEF),
        "sp4-aux": (4, ["--sp", "4", *aux], 1, COEF),
        "dp2xsp2-aux": (4, ["--sp", "2", *aux], 2, COEF),
    }
    for name, (n, extra, nrows, coef) in runs.items():
        out = tmp_path / name
        run_train(n, *_common(tmp_path, out), *extra, "--eval-every", "0")
        m = metrics(out)[0]
        loss, norm = reference_step_with_router_loss(ref, rows[:nrows], coef)
        print(f"{name}: loss {m['loss']:.8f} ({loss:.8f}), grad_norm {m['grad_norm']:.8f}")
        assert m["loss"] == pytest.approx(loss, rel=1e-6)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-6)
        assert len(m["expert_load"]) == MOE.num_hidden_layers  # every layer is sparse


@pytest.mark.slow
def test_released_checkpoint_trains_and_exports_in_its_own_layout(tmp_path):
    """Qwen3_5MoeForConditionalGeneration's layout (text under model.language_model., one
    tensor per expert, a vision tower, an mtp head): trained on sp 2, exported byte-equal outside
    the text model, loaded by transformers."""
    src = tmp_path / "released"
    multimodal_checkpoint(src, MOE, moe=True)
    rows = np.random.default_rng(0).integers(0, MOE.vocab_size, size=(8, 65), dtype=np.int64)
    np.save(tmp_path / "tokens.npy", rows)
    out = tmp_path / "run"
    flags = _common(tmp_path, out)
    flags[flags.index("--model") + 1] = str(src)
    run_train(2, *flags, "--sp", "2", "--eval-every", "0")
    final = out / "final"
    source, exported = {}, {}
    for name in ("model.safetensors", "mtp.safetensors"):
        source.update(load_file(str(src / name)))
    for f in final.iterdir():
        if f.suffix == ".safetensors":
            exported.update(load_file(str(f)))
    assert set(exported) == set(source)
    assert "model.language_model.layers.0.mlp.experts.7.down_proj.weight" in exported
    outside = [
        k for k in source if not k.startswith("model.language_model.") and "lm_head" not in k
    ]
    for k in outside:
        assert exported[k].dtype == source[k].dtype and torch.equal(exported[k], source[k]), k
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(str(final))
    ours = Qwen3_5(MOE)
    load_safetensors(ours, str(final), progress=False)
    ids = torch.as_tensor(rows[:1, :40])
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - ours.logits(ids)).abs().max().item() <= 1e-5


def test_lora_adapts_attention_gdn_and_the_shared_expert_not_the_routed_ones(tmp_path):
    """Every target of the default list lands on the layers that have it: q/k/v/o on attention,
    qkv/z/b/a/out on the Gated DeltaNet, gate/up/down on the shared expert only; the routed
    experts and the router stay frozen without adapters, and the run says so in one line."""
    from model.lora import LoraSpec, add_lora
    from run.adapter import DEFAULT_TARGETS, TARGETS, lora_note
    from run.train_config import TrainConfig

    model = Qwen3_5(MOE)
    add_lora(model, LoraSpec(rank=2, alpha=4, targets=tuple(TARGETS.values())))
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert all(".experts." not in n and not n.endswith("mlp.gate") for n in adapted)
    assert "model.layers.0.mlp.shared_expert.gate_proj" in adapted
    assert "model.layers.0.linear_attn.in_proj_qkv" in adapted
    assert "model.layers.3.self_attn.q_proj" in adapted
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trains)
    note = lora_note(TrainConfig(lora_rank=2, lora_targets=DEFAULT_TARGETS), MOE)
    assert "gate,up,down in every layer's shared expert" in note and "not adapted" in note
