"""A model initialised from scratch is the same full model whatever the sharding.

One process builds the reference: a plain, unsharded Qwen3 and init_weights(seed). Then 1, 2 and 4
gloo processes build it with build_sharded_model (FSDP2 shards, sp 1 and 2, shards in host memory
with cpu_offload) and gather model.state_dict() with full_tensor(): every tensor must equal the
reference exactly. The rows are drawn in blocks; BLOCK_ELEMS is made small in every process so
that blocks of a few rows straddle the shard boundaries, and the shapes are chosen so that no
row count divides by 4 and, at 4 ranks, k_proj's 6 rows leave the last rank an empty shard.
"""

from dataclasses import replace

import pytest
import torch
from dist_utils import run_distributed

from model import seeded_init
from model.config import Qwen3Config
from model.qwen3 import Qwen3

CFG = Qwen3Config(
    vocab_size=301,
    hidden_size=65,
    intermediate_size=97,
    num_hidden_layers=2,
    num_attention_heads=5,
    num_key_value_heads=1,
    head_dim=6,  # k_proj, v_proj: 6 rows, split 2, 2, 2, 0 over 4 ranks
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
)
TIED = replace(CFG, tie_word_embeddings=True)
SEED = 1234
BLOCK_ELEMS = 200  # 3 rows of 65 per block of the embedding: boundaries inside every shard


def _full_state(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}  # collective


def _worker(rank, world, block_elems):
    from model.parallel import build_mesh, build_sharded_model

    seeded_init.BLOCK_ELEMS = block_elems  # this process's copy of the module
    torch.manual_seed(rank)  # a different global RNG on every rank: it must not matter
    out = {}
    for sp in (1, 2) if world > 1 else (1,):
        mesh = build_mesh(world, sp, "cpu")
        for name, cfg, offload in (("untied", CFG, False), ("tied", TIED, False)):
            model, stats = build_sharded_model(cfg, mesh, device="cpu", seed=SEED)
            assert stats is None
            out[(name, sp, offload)] = _full_state(model)
        model, _ = build_sharded_model(CFG, mesh, device="cpu", seed=SEED, cpu_offload=True)
        assert all(p.to_local().device.type == "cpu" for p in model.parameters())
        out[("untied", sp, True)] = _full_state(model)
    return out


def _reference(cfg: Qwen3Config, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(seeded_init, "BLOCK_ELEMS", BLOCK_ELEMS)
    model = Qwen3(cfg)
    model.init_weights(SEED)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_init_is_the_one_process_init(world, monkeypatch):
    refs = {"untied": _reference(CFG, monkeypatch), "tied": _reference(TIED, monkeypatch)}
    results = run_distributed(_worker, world, BLOCK_ELEMS)
    for rank, out in enumerate(results):
        assert len(out) == (3 if world == 1 else 6)  # sp 1 (and 2): untied, tied, untied offloaded
        for (name, sp, offload), state in out.items():
            ref = refs[name]
            assert state.keys() == ref.keys()
            wrong = [k for k in ref if not torch.equal(state[k], ref[k])]
            assert not wrong, f"rank {rank} of {world}, {name}, sp {sp}, offload {offload}: {wrong}"


def test_init_distribution_and_independence(monkeypatch):
    """N(0, initializer_range) for the matrices, ones for the norms; no two weights, blocks or rows
    repeat one another; the seed decides the numbers and nothing else does."""
    ref = _reference(CFG, monkeypatch)
    std = CFG.initializer_range
    for k, v in ref.items():
        if k.endswith("norm.weight"):
            assert torch.equal(v, torch.ones_like(v)), k
        else:
            assert abs(v.std().item() - std) < 0.25 * std and abs(v.mean().item()) < 0.2 * std, k
            assert torch.unique(v, dim=0).shape[0] == v.shape[0], f"{k}: repeated rows"
    for suffix in ("self_attn.q_proj.weight", "mlp.down_proj.weight"):
        a, b = ref[f"model.layers.0.{suffix}"], ref[f"model.layers.1.{suffix}"]
        assert not torch.equal(a[:1], b[:1]), suffix
    assert not torch.equal(ref["lm_head.weight"][:1], ref["model.embed_tokens.weight"][:1])
    tied = _reference(TIED, monkeypatch)
    assert torch.equal(tied["lm_head.weight"], tied["model.embed_tokens.weight"])

    torch.manual_seed(99)  # the global RNG plays no part once a seed is given
    again = _reference(CFG, monkeypatch)
    assert all(torch.equal(again[k], ref[k]) for k in ref)
    other = Qwen3(CFG)
    other.init_weights(SEED + 1)
    assert not torch.equal(other.lm_head.weight, ref["lm_head.weight"])


def test_init_without_a_seed_follows_torch_manual_seed():
    models = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        m = Qwen3(CFG)
        m.init_weights()
        models.append(m.lm_head.weight.detach())
    assert torch.equal(models[0], models[1]) and not torch.equal(models[0], models[2])
