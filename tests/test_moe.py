"""The mixture-of-experts block and model against transformers' Qwen3MoeSparseMoeBlock and
Qwen3MoeForCausalLM: logits, gradients, the router loss, loading and saving."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import transformers
from hf_ref import hf_model, save_hf
from transformers.models.qwen3_moe import modeling_qwen3_moe

from model.config import Qwen3Config
from model.moe import SparseMoeBlock, router_loss
from model.qwen3 import Qwen3
from model.weights import load_safetensors, save_safetensors

# 6 experts, top-4 and renormalised, layer 1 dense by mlp_only_layers.
MOE = replace(
    Qwen3Config.preset("tiny"),
    num_hidden_layers=3,
    num_experts=6,
    num_experts_per_tok=4,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
)
VARIANTS = {
    "top4-norm-dense1": MOE,
    "top2-raw-step2": replace(
        MOE, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=()
    ),
}


def _blocks(model):
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("top_k, norm", [(2, False), (2, True), (4, True), (4, False)])
def test_block_equals_transformers(top_k, norm):
    """Outputs and every gradient equal Qwen3MoeSparseMoeBlock's, with tiles smaller than an
    expert's tokens (several matrix products per expert, several router tiles)."""
    c = transformers.Qwen3MoeConfig(
        hidden_size=32,
        moe_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
    )
    torch.manual_seed(0)
    ref = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(c).float()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = SparseMoeBlock(32, 16, 6, top_k, norm, tile=5)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 17, 32)
    dy = torch.randn(2, 17, 32)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yo = ref(xr), ours(xo)
    assert (yr - yo).abs().max().item() <= 1e-5
    names = [n for n, _ in ref.named_parameters()]
    mine = dict(ours.named_parameters())
    gr = torch.autograd.grad(yr, [xr, *ref.parameters()], dy)
    go = torch.autograd.grad(yo, [xo, *(mine[n] for n in names)], dy)
    for a, b in zip(gr, go, strict=True):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())
    assert ours.stats.counts.sum().item() == 2 * 17 * top_k


def test_block_saves_only_its_input_and_skips_in_a_recompute():
    ours = SparseMoeBlock(32, 16, 6, 2, True, tile=4)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 40, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours(x)
    assert saved[0] is x and sum(t.numel() for t in saved) == x.numel() + sum(
        p.numel() for p in ours.parameters()
    )
    before = ours.stats
    with ours.skipping():
        assert not ours(x).any()
    assert ours.stats is before  # a recompute leaves the forward's statistics


def _load_ours(ref, tmp_path):
    save_hf(ref, str(tmp_path), max_shard_size="20KB")
    ours = Qwen3(Qwen3Config.from_hf(str(tmp_path)))
    stats = load_safetensors(ours, str(tmp_path), progress=False)
    assert stats.bytes_read == stats.checkpoint_bytes
    return ours


@pytest.mark.parametrize("name", list(VARIANTS))
def test_model_logits_and_gradients_equal_transformers(name, tmp_path):
    cfg = VARIANTS[name]
    ref = hf_model(cfg).train()
    ours = _load_ours(ref, tmp_path)
    assert Qwen3Config.from_hf(str(tmp_path)) == cfg
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == [type(layer.mlp).__name__.replace("Qwen3Moe", "") for layer in ref.model.layers]
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    lr, lo = ref(ids).logits, ours.logits(ids)
    assert (lr - lo).abs().max().item() <= 1e-5
    for logits in (lr, lo):
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    ref_params = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        g = ref_params[n].grad
        assert (p.grad - g).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), n


def test_router_loss_equals_transformers(tmp_path):
    """The router loss and its gradients: transformers' loss with output_router_logits on
    against ours with router_loss, one process over both rows."""
    cfg = replace(MOE, norm_topk_prob=False)
    ref = hf_model(cfg).train()
    ours = _load_ours(ref, tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    coef = 0.3  # large, so the router's gradient is mostly the loss's
    ref.config.router_aux_loss_coef = ref.router_aux_loss_coef = coef
    out = ref(ids, labels=ids, output_router_logits=True)  # it shifts the labels inside
    logits = ours.logits(ids)
    aux, load = router_loss(_blocks(ours), coef)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert abs((ce + aux).item() - out.loss.item()) <= 1e-6
    assert abs(aux.item() - coef * out.aux_loss.item()) <= 1e-7
    assert load.shape == (cfg.sparse_layers,) and (load >= 1).all()
    out.loss.backward()
    (ce + aux).backward()
    ref_params = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        g = ref_params[n].grad
        assert (p.grad - g).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), n


def test_export_loads_in_transformers(tmp_path):
    torch.manual_seed(0)
    ours = Qwen3(MOE)
    ours.init_weights(seed=3)
    save_safetensors(ours, str(tmp_path), dtype=torch.float32, progress=False)
    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    ids = torch.randint(0, MOE.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ref(ids).logits - ours.logits(ids)).abs().max().item() <= 1e-5
    again = Qwen3(MOE)
    load_safetensors(again, str(tmp_path), progress=False)  # our own export reads back
    for (n, a), b in zip(ours.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    # a file holding the experts stacked, as transformers 5 holds them in memory, reads too
    from safetensors.torch import save_file

    stacked = tmp_path / "stacked"
    stacked.mkdir()
    save_file(ours.state_dict(), str(stacked / "model.safetensors"))
    again = Qwen3(MOE)
    load_safetensors(again, str(stacked), progress=False)
    assert all(
        torch.equal(a, b) for a, b in zip(ours.parameters(), again.parameters(), strict=True)
    )


# ---- train.py end to end: one step against transformers, resumed on another layout ----------
TRAIN_CFG = replace(
    Qwen3Config(
        vocab_size=211,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        bos_token_id=None,
        eos_token_id=None,
    ),
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=(2,),
)
COEF = 0.05  # the router loss's weight in the runs that add it


def _ref_step(ref, rows, coef: float) -> tuple[float, float]:
    """transformers: mean cross-entropy over every label of the rows plus coef x its router
    loss (load_balancing_loss_func over every row and layer), and the gradient norm."""
    ref.zero_grad()
    ids = torch.as_tensor(rows, dtype=torch.long)
    out = ref(ids[:, :-1], output_router_logits=True)
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten())
    loss = loss + coef * out.aux_loss
    loss.backward()
    norm = torch.norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    return loss.item(), norm.item()


@pytest.mark.slow
def test_train_matches_transformers_on_every_layout_and_resumes_on_another(tmp_path):
    import numpy as np
    from dist_utils import run_train
    from test_train import _common, metrics

    ref = hf_model(TRAIN_CFG, seed=3).train()
    save_hf(ref, str(tmp_path / "model"))
    rng = np.random.default_rng(0)
    rows = rng.integers(0, TRAIN_CFG.vocab_size, size=(8, 65), dtype=np.int64)
    np.save(tmp_path / "tokens.npy", rows)
    aux = ["--router-aux-loss", str(COEF)]
    runs = {  # name: (processes, extra flags, rows per step, router loss coefficient)
        "1proc": (1, ["--sp", "1", "--steps", "2", *aux], 1, COEF),
        # step 1 of 2, then stops with a checkpoint that sp4-resumed continues from
        "sp2": (
            2,
            [
                "--sp",
                "2",
                "--offload",
                "--tile-mlp",
                "16",
                *aux,
                "--steps",
                "2",
                "--save-every",
                "1",
                "--stop-after",
                "1",
            ],
            1,
            COEF,
        ),
        "sp4-kv-repeated": (4, ["--sp", "4", *aux], 1, COEF),  # 2 kv heads over 4 ranks
        "dp2xsp2": (4, ["--sp", "2"], 2, 0.0),
    }
    for name, (n, extra, nrows, coef) in runs.items():
        out = tmp_path / name
        run_train(n, *_common(tmp_path, out), *extra)
        m = metrics(out)[0]
        loss, norm = _ref_step(ref, rows[:nrows], coef)
        print(
            f"{name}: loss {m['loss']:.7f} ({loss:.7f}), "
            f"grad_norm {m['grad_norm']:.7f} ({norm:.7f})"
        )
        assert m["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-6, abs=1e-6)
        assert len(m["expert_load"]) == TRAIN_CFG.sparse_layers
        assert m["expert_load_max"] == max(m["expert_load"]) >= 1
    # the sp2 run's checkpoint, resumed on 4 ranks (sp 4: kv heads repeated)
    run_train(
        4,
        *_common(tmp_path, tmp_path / "sp2"),
        "--sp",
        "4",
        *aux,
        "--steps",
        "2",
        "--resume",
        "auto",
    )
    straight, resumed = metrics(tmp_path / "1proc"), metrics(tmp_path / "sp2")
    print("straight", [m["loss"] for m in straight], "resumed", [m["loss"] for m in resumed])
    assert [m["step"] for m in resumed] == [1, 2]
    for a, b in zip(straight, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    # the export of 4 ranks (6 experts sharded 2, 2, 2, 0) loads in transformers
    final = str(tmp_path / "dp2xsp2" / "final")
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(final, dtype=torch.float32)
    ours = Qwen3(Qwen3Config.from_hf(final))
    load_safetensors(ours, final, progress=False)
    ids = torch.as_tensor(rows[:1, :64])
    with torch.no_grad():
        assert (back(ids).logits - ours.logits(ids)).abs().max().item() <= 1e-5


def test_dry_run_plans_qwen3_30b_a3b_beside_the_public_run(tmp_path, capsys):
    """The published Qwen3-30B-A3B config at the recipe's 1M tokens on 8 x 80 GB: planned (not
    refused), its 30.5B parameters counted with every expert, beside the public run's figures."""
    import json

    import train

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(Qwen3Config.preset("qwen3-30b-a3b").to_hf()))
    argv = ["--preset", "qwen3-8b-1m", "--model", str(model), "--out", str(tmp_path / "out")]
    train.main([*argv, "--dry-run"])
    out = capsys.readouterr().out
    assert "(30.53 B parameters), 1,048,576 tokens, 8 GPUs" in out
    assert "public recipe (Qwen3-30B-A3B, 8 x H100)" in out and "483 s (measured" in out
    assert "GPU memory, less that and 2 GB reserve" in out and " fits" in out


def test_router_aux_loss_flag_and_its_refusal_on_a_dense_model(tmp_path):
    import train
    from model.config import ConfigError

    assert train.parse_args([]).router_aux_loss == 0.0  # off, as transformers has it
    assert train.parse_args(["--router-aux-loss"]).router_aux_loss < 0  # the config's coefficient
    assert train.parse_args(["--router-aux-loss", "0.02"]).router_aux_loss == 0.02
    argv = ["--model", "tiny", "--router-aux-loss", "--check-only", "--out", str(tmp_path / "o")]
    with pytest.raises(ConfigError, match="no router"):
        train.main(argv)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor methods that read values back to the host (each a sync on a GPU)."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_each_sparse_layer_reads_its_counts_once_a_pass(monkeypatch):
    """A sparse layer reads its experts' token counts to the host once in its forward and once
    in its backward; a checkpoint's recompute reads nothing (the block skips). Two sparse layers
    (layer 1 is dense), whole-layer recompute: two reads in the forward, two in the backward. In
    the forward nothing else reads a value back (a torch function mode sees every method call;
    autograd's engine runs the backward outside it, so there the counts' reads are counted)."""
    import model.moe as moe
    from model.checkpoint_offload import apply_offload

    reads = []
    real = moe._host_counts
    monkeypatch.setattr(moe, "_host_counts", lambda c, n: reads.append(n) or real(c, n))
    torch.manual_seed(0)
    model = Qwen3(MOE)
    apply_offload(model, offload=False)
    ids = torch.randint(0, MOE.vocab_size, (1, 48))
    positions = torch.arange(48)[None]
    with HostReads() as forward:
        out = model(ids, positions)
    assert forward.calls == ["tolist"] * 2 and len(reads) == 2
    out.float().pow(2).mean().backward()
    assert reads == [48 * MOE.num_experts_per_tok] * 4  # each the layer's token-expert pairs
