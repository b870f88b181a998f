"""Qwen3.5 (model/qwen3_5.py) against transformers' Qwen3_5ForCausalLM, and through train.py.

The tiny configs have 3 Gated DeltaNet layers and 1 gated attention layer, 4 key heads of the
delta rule to 8 value heads, 4 query heads to 2 kv heads of 32 dimensions with RoPE on 8, tied and
untied embeddings. The reference's norms, conv filters, decays and step sizes are perturbed from
their initial values, so a norm read as w instead of 1 + w, or a decay of the wrong sign, shows.
"""

import json
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from dist_utils import run_train
from hf_ref import ref_loss_and_norm
from safetensors.torch import load_file, save_file
from test_documents import ROW_DOCS, make_row, per_document_reference
from test_train import _common, metrics

from model.config import ConfigError, Qwen3Config
from model.parallel import layout_problem
from model.qwen3_5 import Qwen3_5
from model.weights import load_safetensors

TINY = replace(Qwen3Config.preset("qwen3.5-tiny"), vocab_size=211)  # test_documents' eos is 210
VARIANTS = {"tied": TINY, "untied": replace(TINY, tie_word_embeddings=False)}


def text_config(cfg: Qwen3Config) -> dict:
    return {
        k: v
        for k, v in cfg.to_hf().items()
        if k not in ("architectures", "model_type", "torch_dtype")
    }


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every norm, conv filter, decay and step size away from its initial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias", "conv1d.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def hf_qwen3_5(cfg: Qwen3Config, seed: int = 0) -> transformers.Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    ref = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text_config(cfg)))
    ref = ref.float().eval()
    perturb(ref, seed)
    return ref


def ours_from(ref, path) -> Qwen3_5:
    ref.save_pretrained(str(path))
    ours = Qwen3_5(Qwen3Config.from_hf(str(path)))
    load_safetensors(ours, str(path), progress=False)
    return ours


def gradient_difference(ref, ours, ref_logits, our_logits, labels) -> float:
    """Both models' cross-entropy gradients: the largest difference of any parameter's, on the
    scale of the largest gradient. The reference runs its delta rule in fp32 (even for an fp64
    model), so the small gradients of A_log and dt_bias, sums over every token that mostly
    cancel, carry its rounding at about 4e-5 of their own size."""
    for logits in (ref_logits, our_logits):
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    ref_grads = dict(ref.named_parameters())
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    return max(
        (p.grad - ref_grads[n].grad).abs().max().item() / scale for n, p in ours.named_parameters()
    )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_and_gradients_match_transformers(name, tmp_path):
    cfg = VARIANTS[name]
    ref = hf_qwen3_5(cfg)
    ours = ours_from(ref, tmp_path)
    assert sum(p.numel() for p in ref.parameters()) == cfg.num_params()
    T = 150  # over two 64-token chunks of the delta rule, not a multiple of one
    ids = torch.randint(0, cfg.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(1))
    ref_logits = ref(ids[:, :-1]).logits
    our_logits = ours.logits(ids[:, :-1])
    diff = (our_logits - ref_logits).abs().max().item()
    print(f"{name}: max |logits - transformers| = {diff:.2e}")
    assert diff <= 1e-5

    worst = gradient_difference(ref, ours, ref_logits, our_logits, ids[:, 1:])
    print(f"{name}: max |gradient - transformers| / max |gradient| = {worst:.2e}")
    assert worst <= 1e-5


def test_global_positions_and_documents_match_transformers_alone(tmp_path):
    """Two documents in one row equal transformers on each alone: the conv and the delta rule
    restart at the boundary (a conv reaching across it, or a state carried over, fails)."""
    ref = hf_qwen3_5(TINY, seed=1)
    ours = ours_from(ref, tmp_path)
    lens = (70, 3, 57)
    ids = torch.randint(0, TINY.vocab_size, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        whole = F.linear(ours(ids, pos, doc_lens=lens), ours.lm_head.weight)
        alone, s = [], 0
        for n in lens:
            alone.append(ref(ids[:, s : s + n]).logits)
            s += n
    diff = (whole - torch.cat(alone, dim=1)).abs().max().item()
    print(f"documents: max |logits - transformers on each alone| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5")
    ref = hf_qwen3_5(TINY, seed=3)
    ref.save_pretrained(str(d / "model"))
    rng = np.random.default_rng(0)
    np.save(d / "tokens.npy", rng.integers(0, TINY.vocab_size, size=(8, 65), dtype=np.int64))
    rows = np.stack([make_row(rng, docs) for docs in ROW_DOCS])  # [2, 65]: documents
    np.save(d / "documents.npy", rows)
    return d, ref


def reference_step(ref, rows) -> tuple[float, float]:
    """transformers: mean cross-entropy over every label of the rows, and its gradient norm."""
    return ref_loss_and_norm(ref, rows)[:2]


LAYOUTS = {  # name: (processes, flags, rows per step)
    "1proc": (1, ["--sp", "1"], 1),
    "sp2-offload-tiled": (2, ["--sp", "2", "--offload", "--tile-mlp", "16"], 1),
    "sp4-kv-repeat": (4, ["--sp", "4"], 1),
    "dp2xsp2": (4, ["--sp", "2"], 2),
    "sp2-cpu-offload": (2, ["--sp", "2", "--cpu-offload"], 1),
}


@pytest.mark.slow
def test_train_first_step_matches_transformers_on_every_layout(setup):
    """sp splits the 4 key heads of the delta rule (a rank's value heads must arrive with their
    own key heads) and repeats the 2 kv heads of attention at sp 4."""
    d, ref = setup
    rows = np.load(d / "tokens.npy")
    for name, (n, extra, nrows) in LAYOUTS.items():
        out = d / name
        run_train(n, *_common(d, out), *extra, "--eval-every", "0")
        m = metrics(out)[0]
        loss, norm = reference_step(ref, rows[:nrows])
        print(
            f"{name}: loss {m['loss']:.8f} ({loss:.8f}), grad_norm {m['grad_norm']:.8f} "
            f"({norm:.8f})"
        )
        assert m["loss"] == pytest.approx(loss, rel=1e-6)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-6)


@pytest.mark.slow
def test_documents_match_transformers_per_document(setup):
    d, ref = setup
    rows = np.load(d / "documents.npy")
    loss, norm, count = per_document_reference(ref, rows)
    masked = ["--documents", "masked", "--eos-id", str(TINY.vocab_size - 1), "--grad-accum", "2"]
    for name, n, extra in (("doc-1proc", 1, ["--sp", "1"]), ("doc-sp4", 4, ["--sp", "4"])):
        out = d / name
        flags = _common(d, out)
        flags[flags.index("--data") + 1] = f"tokens:{d / 'documents.npy'}"
        run_train(n, *flags, *masked, *extra, "--eval-every", "0")
        m = metrics(out)[0]
        print(f"{name}: loss {m['loss']:.8f} ({loss:.8f}), grad_norm {m['grad_norm']:.8f}")
        assert m["tokens"] == count
        assert m["loss"] == pytest.approx(loss, rel=1e-6)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-6)


def multimodal_checkpoint(path, cfg: Qwen3Config, moe: bool = False) -> None:
    """A tiny released-style Qwen3.5: transformers' Qwen3_5ForConditionalGeneration (text model
    under model.language_model., a vision tower) plus a multi-token prediction head's tensors in
    a file of their own, as real checkpoints carry (transformers does not model mtp)."""
    torch.manual_seed(5)
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=cfg.hidden_size,
        patch_size=4,
        num_position_embeddings=16,
    )
    kinds = (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration)
    if moe:
        kinds = (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration)
    config = kinds[0](
        text_config=text_config(cfg),
        vision_config=vision,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    model = kinds[1](config)
    perturb(model, 5)
    model.save_pretrained(str(path))
    mtp = {"mtp.fc.weight": torch.randn(cfg.hidden_size, 2 * cfg.hidden_size)}
    mtp["mtp.norm.weight"] = torch.randn(cfg.hidden_size).to(torch.bfloat16)
    save_file(mtp, str(path / "mtp.safetensors"), metadata={"format": "pt"})


@pytest.mark.slow
def test_multimodal_checkpoint_trains_and_exports_in_its_own_layout(setup, tmp_path):
    d, _ = setup
    cfg = replace(TINY, tie_word_embeddings=False)
    src = tmp_path / "released"
    multimodal_checkpoint(src, cfg)
    out = tmp_path / "run"
    flags = _common(d, out)
    flags[flags.index("--model") + 1] = str(src)
    run_train(2, *flags, "--sp", "2", "--eval-every", "0")
    final = out / "final"
    with open(src / "config.json") as f, open(final / "config.json") as g:
        assert json.load(f) == json.load(g)
    source = {}
    for name in ("model.safetensors", "mtp.safetensors"):
        source.update(load_file(str(src / name)))
    exported = {}
    for name in os.listdir(final):
        if name.endswith(".safetensors"):
            exported.update(load_file(str(final / name)))
    assert set(exported) == set(source)
    outside = [
        k for k in source if not k.startswith("model.language_model.") and "lm_head" not in k
    ]
    assert any(k.startswith("model.visual.") for k in outside) and "mtp.fc.weight" in outside
    for k in outside:  # byte-equal: dtype, shape and every bit
        assert exported[k].dtype == source[k].dtype and torch.equal(exported[k], source[k]), k
    trained = [k for k in source if k not in outside]
    assert all(not torch.equal(exported[k], source[k]) for k in trained if "embed" not in k)
    loaded = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(final))
    text = transformers.Qwen3_5ForCausalLM.from_pretrained(str(final))
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        a = loaded(input_ids=ids).logits
        b = text(input_ids=ids).logits
    assert (a - b).abs().max().item() <= 1e-5


def test_configs_and_refusals():
    multimodal = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {**text_config(TINY), "model_type": "qwen3_5_text"},
        "vision_config": {"depth": 1},
    }
    multimodal["text_config"].pop("tie_word_embeddings")
    multimodal["text_config"].pop("layer_types")  # full_attention_interval's default: every 4th
    cfg = Qwen3Config.from_hf(multimodal)
    assert cfg == replace(TINY, tie_word_embeddings=False)
    assert cfg.rotary_dim == 8 and cfg.linear_layers == 3 and cfg.attention_layers == 1
    with pytest.raises(ConfigError, match="Qwen3-Next"):
        Qwen3Config.from_hf({"model_type": "qwen3_next", "architectures": []})
    assert "sp=8 does not divide 4" in layout_problem(8, 8, 8, 8, 2, linear_key_heads=4)
    assert layout_problem(4, 4, 4, 4, 2, linear_key_heads=4) is None


def test_the_recipe_scales_rope_from_the_models_own_context():
    """--preset qwen3-8b-1m asks YaRN for 1,048,576 tokens from the model's native context: x32
    over Qwen3's 32,768 (config.json says 40,960), x4 over 262,144 for Qwen3.5 and Qwen3-4B-2507."""
    from run.checks import resolve_model
    from run.train_config import PRESETS, TrainConfig

    cfg = TrainConfig(**PRESETS["qwen3-8b-1m"][1])
    for model, factor, native in (
        ("qwen3-8b", 32, 32768),
        ("qwen3.5-9b", 4, 262144),
    ):
        mc, _ = resolve_model(replace(cfg, model=model), download=False, weights=False)
        assert (mc.yarn.factor, mc.yarn.original_max_position_embeddings) == (factor, native)
    qwen3_2507 = replace(Qwen3Config.preset("qwen3-4b"), max_position_embeddings=262144)
    assert qwen3_2507.yarn_to(1 << 20).yarn.factor == 4
    assert Qwen3Config.preset("qwen3.5-9b").yarn_to(262144).yarn is None
    assert TrainConfig().yarn_factor == 0  # without the preset RoPE stays as configured


def test_lora_on_every_linear_matches_peft(tmp_path):
    """LoRA on attention, the Gated DeltaNet projections and the MLP under PEFT's names: logits
    and the adapters' gradients equal PEFT's LoraModel on transformers' Qwen3_5ForCausalLM."""
    import peft

    from model.lora import LoraLinear, LoraSpec, add_lora, init_lora
    from run.adapter import DEFAULT_TARGETS, TARGETS

    targets = tuple(TARGETS[t] for t in DEFAULT_TARGETS.split(","))
    spec = LoraSpec(rank=4, alpha=8, targets=targets)
    ref = hf_qwen3_5(TINY, seed=2)
    ours = ours_from(ref, tmp_path)
    add_lora(ours, spec)
    init_lora(ours, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, LoraLinear):  # B starts at zero: give it values that show
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
    lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets))
    theirs = peft.get_peft_model(ref, lc)
    state = {
        "base_model.model."
        + k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
        for k, v in ours.state_dict().items()
        if "lora_" in k
    }
    adapted = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state}
    assert adapted == set(targets)  # every linear of both kinds of layer got adapters
    assert not theirs.load_state_dict(state, strict=False).unexpected_keys
    ids = torch.randint(0, TINY.vocab_size, (1, 90), generator=torch.Generator().manual_seed(3))
    ours_logits, their_logits = ours.logits(ids), theirs(input_ids=ids).logits
    assert (ours_logits - their_logits).abs().max().item() <= 1e-5
    for logits in (ours_logits, their_logits):
        F.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    theirs_grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    scale = max(g.abs().max().item() for g in theirs_grads.values())
    for n, p in ours.named_parameters():
        if p.requires_grad:
            key = "base_model.model." + n.replace(".lora_A.", ".lora_A.default.").replace(
                ".lora_B.", ".lora_B.default."
            )
            assert (p.grad - theirs_grads[key]).abs().max().item() <= 1e-5 * scale, n


@pytest.mark.slow
def test_resume_on_another_layout_and_seeded_init(setup):
    """Two steps on sp 2, then two more resumed on one process, equal an uninterrupted run (with
    its held-out evaluations); a run from scratch starts from the same weights at sp 1 and 2."""
    d, _ = setup
    args = [
        *["--model", str(d / "model"), "--data", f"tokens:{d / 'tokens.npy'}"],
        *["--seq-len", "64", "--lr", "1e-2", "--warmup-steps", "1", "--dtype", "float32"],
        *["--loss-chunk", "16", "--eval-every", "2", "--steps", "4"],
    ]
    run_train(2, *args, "--sp", "2", "--out", str(d / "straight"))
    resumed = ["--out", str(d / "resumed"), "--save-every", "2"]
    run_train(2, *args, *resumed, "--sp", "2", "--stop-after", "2")
    run_train(1, *args, *resumed, "--sp", "1", "--resume", "auto")
    straight, again = metrics(d / "straight"), metrics(d / "resumed")
    assert len(again) == 4
    for a, b in zip(straight, again, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    scratch = ["--model", "qwen3.5-tiny", "--data", f"tokens:{d / 'tokens.npy'}"]
    scratch += ["--seq-len", "64", "--steps", "1", "--dtype", "float32", "--eval-every", "0"]
    run_train(1, *scratch, "--sp", "1", "--out", str(d / "scratch1"))
    run_train(2, *scratch, "--sp", "2", "--out", str(d / "scratch2"))
    one, two = metrics(d / "scratch1")[0], metrics(d / "scratch2")[0]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
