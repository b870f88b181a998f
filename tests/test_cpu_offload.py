"""FSDP2 CPU offload (cpu_offload=True): the same step as without it, with the state on the host.

Two gloo processes build the same model twice from one safetensors export: once as usual and once
with the fp32 shards, gradients and AdamW states in host memory (CPUOffloadPolicy). Loaded weights,
the loss, every gradient, the global gradient norm and the parameters after one clipped AdamW step
must be equal. On CPU the two differ only in FSDP2's bookkeeping (the copies to the "device" are
no-ops), so any difference is a real one; the offload flag itself is checked on every unit.
The parent holds the reference loss: one process, the same weights, F.cross_entropy over both rows.
"""

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed

from model.config import Qwen3Config

CFG = replace(
    Qwen3Config.preset("tiny"),
    vocab_size=97,
    hidden_size=48,
    intermediate_size=72,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=16,
)  # uneven shards over 2
T = 20


def _worker(rank, world, export, ids, labels):
    from torch.distributed.fsdp import FSDPModule

    from loss.chunked_ce import chunked_cross_entropy
    from model.parallel import build_mesh, build_sharded_model
    from model.weights import save_safetensors

    mesh = build_mesh(world, 1, "cpu")
    torch.manual_seed(3)
    ref, _ = build_sharded_model(CFG, mesh, device="cpu")
    save_safetensors(ref, export, progress=False)
    dist.barrier()
    out = {}
    for off in (False, True):
        model, stats = build_sharded_model(
            CFG, mesh, device="cpu", model_dir=export, progress=False, cpu_offload=off
        )
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        groups = [
            m._get_fsdp_state()._fsdp_param_group for m in units
        ]  # private: None without params
        flags = {fp.offload_to_cpu for pg in groups if pg is not None for fp in pg.fsdp_params}
        count = (labels[rank] != -100).sum()  # this rank's row, then all ranks'
        dist.all_reduce(count)
        hidden = model(ids[rank : rank + 1])
        loss = (
            chunked_cross_entropy(
                hidden.flatten(0, 1),
                model.lm_head.weight,
                labels[rank],
                chunk_size=7,
                reduction="sum",
            )
            / count
        )
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters()], 0.05, foreach=True
        ).full_tensor()
        opt = torch.optim.AdamW(
            model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1, foreach=True
        )
        opt.step()
        params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out[off] = dict(
            flags=flags,
            loss=total.item(),
            grads=grads,
            norm=norm.item(),
            params=params,
            loaded=stats.bytes_read,
            devices={str(p.device) for p in model.parameters()},
            state_devices={
                str(v.device)
                for s in opt.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.dim()
            },
        )
    return out


def test_cpu_offload_step_equals_plain(tmp_path):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, CFG.vocab_size, (2, T), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (2, T), generator=g)
    labels[1, :6] = -100
    export = str(tmp_path / "export")
    r = run_distributed(_worker, 2, export, ids, labels)[0]
    plain, off = r[False], r[True]
    assert plain["flags"] == {False} and off["flags"] == {
        True
    }  # the flag reached every fully_shard
    assert off["loaded"] == plain["loaded"] > 0

    # The reference loss: one process, the exported weights, torch's own cross-entropy.
    from model.qwen3 import Qwen3
    from model.weights import load_safetensors

    one = Qwen3(CFG)
    load_safetensors(one, export, progress=False)
    with torch.no_grad():
        ref = F.cross_entropy(one.logits(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert abs(plain["loss"] - ref.item()) < 1e-5 and abs(off["loss"] - ref.item()) < 1e-5

    assert off["norm"] == plain["norm"] and off["norm"] > 0.05  # clipping did act
    for n, gp in plain["grads"].items():
        assert gp.abs().max() > 0, n
        torch.testing.assert_close(off["grads"][n], gp, rtol=0, atol=0, msg=n)
    for n, p in plain["params"].items():
        torch.testing.assert_close(off["params"][n], p, rtol=0, atol=0, msg=n)
    assert off["devices"] == off["state_devices"] == {"cpu"}


# ---- train.py --cpu-offload end to end: the same run as without it, and an exact resume ----------
@pytest.mark.slow
def test_train_cpu_offload_matches_and_resumes_exactly(tmp_path):
    """Two processes (sp=2), 4 steps: --cpu-offload gives the same losses and gradient norms as the
    plain run, and 2 steps + a DCP checkpoint of the host-side state + 2 resumed steps give the
    same as 4 straight ones, and the same final weights."""
    import numpy as np
    from dist_utils import run_train
    from hf_ref import hf_model, save_hf
    from safetensors.torch import load_file
    from test_train import CFG as TRAIN_CFG  # 4 heads, 2 kv heads: sp=2 fits
    from test_train import metrics

    save_hf(hf_model(TRAIN_CFG, seed=3), str(tmp_path / "model"))
    np.save(
        tmp_path / "tokens.npy",
        np.random.default_rng(0).integers(0, TRAIN_CFG.vocab_size, (8, 33), dtype=np.int64),
    )
    args = [
        "--model",
        str(tmp_path / "model"),
        "--data",
        f"tokens:{tmp_path / 'tokens.npy'}",
        "--seq-len",
        "32",
        "--lr",
        "1e-2",
        "--warmup-steps",
        "1",
        "--dtype",
        "float32",
        "--sp",
        "2",
        "--loss-chunk",
        "8",
        "--steps",
        "4",
        "--save-dtype",
        "float32",
        "--grad-clip",
        "0.5",
    ]
    run_train(2, *args, "--out", str(tmp_path / "plain"))
    run_train(2, *args, "--cpu-offload", "--out", str(tmp_path / "straight"))
    run_train(
        2,
        *args,
        "--cpu-offload",
        "--out",
        str(tmp_path / "resumed"),
        "--save-every",
        "2",
        "--stop-after",
        "2",
    )
    assert os.path.isdir(tmp_path / "resumed" / "checkpoints" / "step_000002")
    run_train(2, *args, "--cpu-offload", "--out", str(tmp_path / "resumed"), "--resume", "auto")
    got = {
        k: [(m["loss"], m["grad_norm"]) for m in metrics(tmp_path / k)]
        for k in ("plain", "straight", "resumed")
    }
    print(got)
    assert (
        len(got["plain"]) == 4
        and got["straight"] == got["plain"]
        and got["resumed"] == got["plain"]
    )
    assert got["plain"][0][1] > 0.5  # clipping acted (the norm is taken over host-side gradients)
    w = [
        load_file(str(f))
        for k in ("plain", "resumed")
        for f in sorted((tmp_path / k / "final").glob("*.safetensors"))
    ]
    assert w[0].keys() == w[1].keys() and all(torch.equal(w[0][n], w[1][n]) for n in w[0])
