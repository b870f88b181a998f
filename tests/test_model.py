"""Our Qwen3 against transformers' Qwen3ForCausalLM: logits, gradients, loading and saving."""

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from hf_ref import config_variants, hf_model, save_hf
from transformers.models.qwen3 import modeling_qwen3

from model.config import Qwen3Config
from model.qwen3 import Qwen3, rope_cos_sin, rope_inv_freq
from model.weights import load_safetensors, save_safetensors

VARIANTS = config_variants()


def _fp64_rope_forward(self, x, position_ids):
    """transformers' rotary forward with the angle product in float64 instead of float32.

    The reference computes position x frequency in float32, which is itself off by up to
    ulp(position)/2 rad at large positions; to compare definitions rather than rounding we let
    it use float64 there, exactly as our model does. Frequencies stay transformers' own."""
    freqs = position_ids[..., None].double() * self.inv_freq.double()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (
        emb.sin() * self.attention_scaling
    ).to(x.dtype)


def _load_ours(ref, tmp_path):
    save_hf(ref, str(tmp_path))
    files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(files) > 1, "the reference checkpoint should span several files"
    ours = Qwen3(Qwen3Config.from_hf(str(tmp_path)))
    stats = load_safetensors(ours, str(tmp_path), progress=False)
    assert stats.bytes_read == stats.checkpoint_bytes  # one process reads every tensor once
    return ours


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name, tmp_path, monkeypatch):
    cfg = VARIANTS[name]
    ref = hf_model(cfg)
    ours = _load_ours(ref, tmp_path)
    # YaRN variants run past original_max_position_embeddings (64 and 16 here).
    T = 96 if cfg.yarn is None else max(96, 3 * cfg.yarn.original_max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours.logits(ids) - ref(ids).logits).abs().max().item()
    print(f"{name}: max |logits - transformers| = {diff:.2e}")
    assert diff <= 1e-4

    # A sequence shard passes global positions: a large offset, different per batch row.
    monkeypatch.setattr(modeling_qwen3.Qwen3RotaryEmbedding, "forward", _fp64_rope_forward)
    pos = torch.arange(T).expand(2, T) + torch.tensor([[500_000], [999_000]])
    with torch.no_grad():
        diff = (ours.logits(ids, pos) - ref(ids, position_ids=pos).logits).abs().max().item()
    print(f"{name} at offset ~1e6: max |logits - transformers| = {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("name", ["untied-gqa2", "tied-mha", "yarn32"])
def test_gradients_match_transformers(name, tmp_path):
    cfg = VARIANTS[name]
    ref = hf_model(cfg).train()
    ours = _load_ours(ref, tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    for m in (ref, ours):
        logits = m(ids).logits if m is ref else m.logits(ids)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    ref_grads = dict(ref.named_parameters())
    worst = 0.0
    for n, p in ours.named_parameters():
        g_ref = ref_grads[n].grad
        scale = g_ref.abs().max().item()
        err = (p.grad - g_ref).abs().max().item()
        worst = max(worst, err / scale)
        assert err <= 1e-4 * scale + 1e-7, f"{n}: grad off by {err:.2e} (scale {scale:.2e})"
    print(f"{name}: worst relative gradient difference {worst:.2e}")


def test_rope_angles_float64_at_a_million():
    """Our cos/sin at position ~1e6 equal a float64 numpy evaluation; float32 angles do not."""
    cfg = Qwen3Config.preset("qwen3-8b").with_yarn(32, 32768)
    pos = torch.arange(1_048_000, 1_048_576).view(1, -1)
    cos, sin = rope_cos_sin(cfg, pos, torch.float64)
    inv, scale = rope_inv_freq(cfg)
    ang = pos.numpy()[0, :, None].astype(np.float64) * inv.numpy().astype(np.float64)[None, :]
    ref_cos = np.cos(np.concatenate([ang, ang], -1)) * scale
    assert np.abs(cos[0].numpy() - ref_cos).max() < 1e-9
    f32 = (pos.float()[..., None] * inv).cos() * scale  # what a float32 angle would give
    assert (f32[0].double().numpy() - ref_cos[:, :64]).__abs__().max() > 1e-3
    # transformers' own YaRN frequencies and attention factor, bit for bit
    rot = modeling_qwen3.Qwen3RotaryEmbedding(hf_model_config := _hf_cfg(cfg))
    assert torch.equal(rot.inv_freq, inv) and math.isclose(rot.attention_scaling, scale)
    del hf_model_config


def _hf_cfg(cfg):
    from hf_ref import hf_config

    return hf_config(cfg)


def test_save_then_transformers_loads(tmp_path):
    cfg = VARIANTS["yarn4"]
    ref = hf_model(cfg)
    ours = _load_ours(ref, tmp_path / "in")
    (tmp_path / "in" / "tokenizer.json").write_text("{}")
    files = save_safetensors(
        ours,
        str(tmp_path / "out"),
        dtype=torch.float32,
        max_shard_bytes=60_000,
        tokenizer_dir=str(tmp_path / "in"),
        progress=False,
    )
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert (tmp_path / "out" / "tokenizer.json").exists()
    back = transformers.Qwen3ForCausalLM.from_pretrained(
        str(tmp_path / "out"), torch_dtype=torch.float32
    ).eval()
    assert back.config.rope_parameters["rope_type"] == "yarn"
    ids = torch.randint(0, cfg.vocab_size, (1, 300))
    with torch.no_grad():
        assert (back(ids).logits - ours.logits(ids)).abs().max().item() <= 1e-5


def test_tied_save_omits_lm_head_and_bf16_default(tmp_path):
    cfg = VARIANTS["tied-mha"]
    ours = Qwen3(cfg)
    ours.init_weights()
    save_safetensors(ours, str(tmp_path), progress=False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys and "model.layers.1.mlp.down_proj.weight" in keys
    back = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


def test_state_dict_keys_are_hf_keys():
    for cfg in (VARIANTS["untied-gqa2"], VARIANTS["tied-mha"]):
        ref_keys = set(hf_model(cfg).state_dict())
        assert set(Qwen3(cfg).state_dict()) == ref_keys


# ---- bad input ------------------------------------------------------------------------------
def test_bad_checkpoints_are_reported_together(tmp_path):
    cfg = VARIANTS["untied-gqa2"]
    ref = hf_model(cfg)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    del sd["model.layers.0.mlp.up_proj.weight"]
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    sd["model.norm.weight"] = torch.zeros(7)
    from safetensors.torch import save_file

    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_safetensors(Qwen3(cfg), str(tmp_path), progress=False)
    msg = str(e.value)
    assert "missing (1): model.layers.0.mlp.up_proj.weight" in msg
    assert "unexpected (1): model.layers.0.mlp.extra.weight" in msg
    assert "mis-shaped (1): model.norm.weight" in msg


def test_bad_paths_and_configs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_safetensors(Qwen3(VARIANTS["untied-gqa2"]), str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        load_safetensors(Qwen3(VARIANTS["untied-gqa2"]), str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        Qwen3Config.from_hf(str(tmp_path / "nope"))
    llama = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ValueError, match="is not a Qwen3"):
        Qwen3Config.from_hf(str(tmp_path))
    base = {**VARIANTS["untied-gqa2"].to_hf()}
    for bad, match in (
        (dict(use_sliding_window=True), "sliding-window"),
        (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]), "num_experts"),
        (dict(model_type="qwen3_moe"), "is not a Qwen3"),  # a dense class for MoE
        (dict(num_experts=8), "mixture-of-experts"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
        (dict(num_key_value_heads=3), "multiple of"),
    ):
        with pytest.raises(ValueError, match=match):
            Qwen3Config.from_hf({**base, **bad})
    with pytest.raises(ValueError, match="unknown Qwen3 preset"):
        Qwen3Config.preset("qwen3-9b")


def test_from_hf_reads_both_rope_layouts():
    cfg = Qwen3Config.preset("qwen3-8b").with_yarn(32, 32768)
    old = cfg.to_hf()  # rope_theta + rope_scaling
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 32.0,
        "original_max_position_embeddings": 32768,
    }
    assert Qwen3Config.from_hf(old) == cfg
    assert Qwen3Config.from_hf(new) == cfg
    hf = _hf_cfg(cfg).to_dict()  # whatever layout the installed transformers writes
    assert Qwen3Config.from_hf(hf) == cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_autograd_and_saves_only_input_and_rstd(dtype):
    """Our RMSNorm's hand-written backward equals autograd through transformers' expression,
    while keeping just x and one fp32 number per row for backward."""
    from model.qwen3 import RMSNorm

    ref = modeling_qwen3.Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    ours = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.1 * torch.randn(64))
        ours.weight.copy_(ref.weight)
    x = torch.randn(4, 9, 64, dtype=dtype)
    dy = torch.randn(4, 9, 64, dtype=dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
    ):
        xo = x.clone().requires_grad_()
        yo = ours(xo)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    assert torch.equal(yo, yr)
    go = torch.autograd.grad(yo, [xo, ours.weight], dy)
    gr = torch.autograd.grad(yr, [xr, ref.weight], dy)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the final cast
    for a, b in zip(go, gr, strict=True):
        assert (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item()
    n = x.numel()
    assert sum(saved) == n * x.element_size() + 64 * ours.weight.element_size() + (n // 64) * 4
