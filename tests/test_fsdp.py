"""FSDP2 sharding with 1-4 gloo processes, against transformers and against one process.

One launch per world size does everything, because starting processes is most of the cost:
load a transformers checkpoint (several files, no dimension divisible by 2, 3 or 4) into the
shards, compare logits on every rank, count the bytes each rank read, export, then take one
AdamW step with a different row on every rank. The parent process holds the references: the
transformers model, its logits, from_pretrained of the export, and one process taking the mean
loss of all the rows. transformers is imported only here in the parent, never in the workers.
"""

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed

from model.config import Qwen3Config
from model.qwen3 import Qwen3

# Rows of every parameter: vocab 301, hidden 65, intermediate 97, q 5x14=70, kv 14 or 70, head_dim
# 14: none divisible by 3 or 4, and only the head_dim multiples by 2, so shards are uneven.
ODD = Qwen3Config(
    vocab_size=301,
    hidden_size=65,
    intermediate_size=97,
    num_hidden_layers=2,
    num_attention_heads=5,
    num_key_value_heads=1,
    head_dim=14,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
)
CONFIGS = {"untied": ODD, "tied": replace(ODD, tie_word_embeddings=True, num_key_value_heads=5)}
T = 24  # tokens per row
LR = 1e-2
# Adam divides by |g| + eps: with the default 1e-8 an element whose gradient is fp32 rounding noise
# (|g| ~ 1e-8 next to a largest |g| ~ 1e-2) moves by up to a full lr, on noise that differs with
# the summation order. A larger eps keeps the comparison about the reduction, not about noise.
EPS = 1e-4


def _mesh_sp(world: int) -> int:
    return 2 if world == 4 else 1  # 4 processes: dp=2 x sp=2, FSDP2 over all four


# ---- the worker: one call per rank does every check ----------------------------------------------
def _worker(rank, world, cases, out_root):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from model.parallel import build_mesh, build_sharded_model
    from model.weights import save_safetensors

    mesh = build_mesh(world, _mesh_sp(world), "cpu")
    results = {"mesh_errors": _mesh_errors(world) if world == 4 else []}
    for name, case in cases.items():
        cfg, r = case["config"], {}
        model, stats = build_sharded_model(
            cfg, mesh, device="cpu", model_dir=case["dir"], progress=False
        )
        assert all(
            isinstance(p, DTensor) and p.device_mesh.size() == world for p in model.parameters()
        )
        assert isinstance(model.model.layers[-1], FSDPModule) and isinstance(model, FSDPModule)
        assert (
            isinstance(model.lm_head, FSDPModule) != cfg.tie_word_embeddings
        )  # tied: in the root unit
        r["bytes_read"], r["checkpoint_bytes"] = stats.bytes_read, stats.checkpoint_bytes

        with torch.no_grad():
            r["logits_diff"] = (model.logits(case["ids"]) - case["ref_logits"]).abs().max().item()

        export = os.path.join(out_root, name)
        save_safetensors(
            model, export, max_shard_bytes=60_000, tokenizer_dir=case["dir"], progress=False
        )
        assert os.path.isfile(os.path.join(export, "config.json"))  # the save returns once written

        # One AdamW step, rank r on row r; loss = local token-loss sum / GLOBAL label count.
        ids, labels = case["rows_ids"][rank : rank + 1], case["rows_labels"][rank : rank + 1]
        count = (labels != -100).sum()
        dist.all_reduce(count)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1)
        logits = model.logits(ids)
        loss = (
            F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
            )
            / count
        )
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # collective
        opt.step()
        params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            r["grads"], r["params"] = grads, params
        results[name] = r

    if world == 2:  # from scratch: init_weights on the shards
        model, stats = build_sharded_model(CONFIGS["tied"], mesh, device="cpu")
        w = model.model.embed_tokens.weight.full_tensor()
        results["init"] = (
            stats,
            w.std().item(),
            model.model.norm.weight.full_tensor().unique().tolist(),
        )
    return results


def _mesh_errors(world):
    from model.parallel import build_mesh

    errors = []
    for sp, local in ((3, "4"), (4, "3"), (2, "3")):
        os.environ["LOCAL_WORLD_SIZE"], saved = local, os.environ["LOCAL_WORLD_SIZE"]
        try:
            build_mesh(world, sp, "cpu")
        except ValueError as e:
            errors.append(str(e))
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    try:
        build_mesh(world + 1, 1, "cpu")
    except ValueError as e:
        errors.append(str(e))
    return errors


# ---- the parent: references ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from hf_ref import hf_model, save_hf

    from model.weights import load_safetensors

    out = {}
    for name, cfg in CONFIGS.items():
        d = tmp_path_factory.mktemp(name)
        ref = hf_model(cfg)
        save_hf(ref, str(d))
        (d / "tokenizer.json").write_text("{}")
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
        rows_ids = torch.randint(0, cfg.vocab_size, (4, T), generator=g)
        rows_labels = torch.randint(0, cfg.vocab_size, (4, T), generator=g)
        rows_labels[
            torch.rand(4, T, generator=g) < torch.tensor([[0.1], [0.5], [0.0], [0.3]])
        ] = -100
        with torch.no_grad():
            ref_logits = ref(ids).logits
            for p in ref.parameters():  # the weights a bf16 export holds
                p.copy_(p.bfloat16().float())
            ref_bf16_logits = ref(ids).logits
        plain = Qwen3(cfg)
        load_safetensors(plain, str(d), progress=False)
        out[name] = dict(
            config=cfg,
            dir=str(d),
            ids=ids,
            ref_logits=ref_logits,
            rows_ids=rows_ids,
            rows_labels=rows_labels,
            ref_bf16_logits=ref_bf16_logits,
            plain=plain,
            files=sorted(f for f in os.listdir(d) if f.endswith(".safetensors")),
        )
    return out


def _one_process_step(plain: Qwen3, ids, labels):
    """Gradients and parameters after one AdamW step on the mean loss of all rows, unsharded."""
    model = Qwen3(plain.config)
    model.load_state_dict(plain.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1)
    F.cross_entropy(model.logits(ids).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return grads, {n: p.detach() for n, p in model.named_parameters()}


def _expected_bytes(directory: str, world: int) -> list[int]:
    """Bytes each rank should read: its torch.chunk share of every tensor's rows (FSDP2's split)."""
    from safetensors import safe_open

    out = [0] * world
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(directory, f), "pt") as st:
                for k in st.keys():
                    shape = st.get_slice(k).get_shape()
                    row = 4 * torch.Size(shape[1:]).numel()  # the files are fp32
                    for r, chunk in enumerate(torch.empty(shape[0]).chunk(world)):
                        out[r] += len(chunk) * row
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_load_logits_export_and_step(world, cases, tmp_path):
    import transformers
    from safetensors import safe_open

    send = {
        n: {k: v for k, v in c.items() if k not in ("plain", "ref_bf16_logits", "files")}
        for n, c in cases.items()
    }
    results = run_distributed(_worker, world, send, str(tmp_path))

    for name, case in cases.items():
        assert len(case["files"]) > 1, "the reference checkpoint should span several files"
        per_rank = [r[name] for r in results]
        # logits on every rank
        diffs = [r["logits_diff"] for r in per_rank]
        print(
            f"world {world} {name}: max |logits - transformers| per rank = "
            f"{[f'{d:.1e}' for d in diffs]}"
        )
        assert max(diffs) <= 1e-4

        # bytes read: each byte of the checkpoint exactly once over all ranks, ~1/world per rank
        ckpt = per_rank[0]["checkpoint_bytes"]
        read = [r["bytes_read"] for r in per_rank]
        print(
            f"world {world} {name}: bytes read per rank {read} of {ckpt} = "
            f"{[round(b / ckpt, 3) for b in read]} (1/world = {1 / world:.3f})"
        )
        assert sum(read) == ckpt and read == _expected_bytes(case["dir"], world)

        # export: bf16 HF layout in several files, tokenizer copied, transformers loads it
        export = tmp_path / name
        assert (export / "model.safetensors.index.json").exists() and (
            export / "tokenizer.json"
        ).exists()
        files = sorted(export.glob("*.safetensors"))
        assert len(files) > 1, "the export should span several files"
        for file in files:
            with safe_open(str(file), "pt") as f:
                assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
        back = transformers.Qwen3ForCausalLM.from_pretrained(
            str(export), dtype=torch.float32
        ).eval()
        with torch.no_grad():
            diff = (back(case["ids"]).logits - case["ref_bf16_logits"]).abs().max().item()
        print(f"world {world} {name}: export -> from_pretrained, max |logits diff| = {diff:.1e}")
        assert diff <= 1e-4

        # data parallel: same gradients and parameters as one process on the mean loss of all rows
        grads, params = _one_process_step(
            case["plain"], case["rows_ids"][:world], case["rows_labels"][:world]
        )
        got = per_rank[0]
        assert got["grads"].keys() == grads.keys()
        worst_g = max(
            ((got["grads"][n] - g).abs().max() / g.abs().max()).item() for n, g in grads.items()
        )
        worst_p = max((got["params"][n] - p).abs().max().item() for n, p in params.items())
        print(
            f"world {world} {name}: worst relative gradient diff {worst_g:.1e}, "
            f"worst parameter diff after AdamW {worst_p:.1e}"
        )
        assert worst_g <= 1e-5 and worst_p <= 1e-6  # a few fp32 ulps at |w| ~ 1

    if world == 4:
        errors = results[0]["mesh_errors"]
        assert len(errors) == 4, errors
        assert "sp=3 does not divide the 4 processes" in errors[0]
        assert "sp=4 spans nodes but is not a multiple of the 3 processes" in errors[1]
        assert "sp=2 does not divide the 3 processes of a node" in errors[2]
        assert "build_mesh(world_size=5) but the process group has 4 ranks" in errors[3]
    if world == 2:
        stats, std, norm_values = results[0]["init"]
        assert stats is None and 0.015 < std < 0.025 and norm_values == [1.0]


def test_build_mesh_needs_a_process_group():
    from model.parallel import build_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        build_mesh(2, 1, "cpu")
