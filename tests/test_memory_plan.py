"""The memory planner against reality: allocated bytes, saved tensors, recipe figures, the CLI.

What can be measured on a CPU is measured: parameter, gradient and AdamW bytes of a real model
after one step (whole, and sharded by FSDP2 over a fake 4-rank world), and the tensors autograd
saves in one decoder layer, with and without Ulysses attention. The rest is checked against
figures derived by hand for the recipe (Qwen3-8B, 1M tokens, 8 GPUs, sp=8).
"""

import concurrent.futures
import json
import math
import multiprocessing
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from memory.buffers import Buffer, layer_backward_moments, layer_saved_bytes
from memory.choices import max_seq_len, plan_for_run
from memory.layouts import choose_layout
from memory.model_size import param_shapes, shard_numel
from memory.plan import GB, GiB, plan
from memory.report import format_plan, plan_to_dict
from model.config import Qwen3Config
from model.host_pool import host_bytes_for
from model.lora import LoraSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_8B = Qwen3Config.preset("qwen3-8b")
T_1M = 1_048_576

# every linear layer of the decoder adapted, with dropout on the adapters' input, and q and v
# alone (the frozen o_proj and MLP then keep none of their inputs)
LORAS = {
    "lora": LoraSpec(rank=8),
    "lora dropout": LoraSpec(rank=8, dropout=0.1),
    "lora q, v": LoraSpec(rank=8, targets=("q_proj", "v_proj")),
}
TINY = Qwen3Config.preset("tiny")  # untied, GQA 2, head_dim 32 != 64 / 4
CONFIGS = {
    "tiny": TINY,
    "tied": replace(TINY, tie_word_embeddings=True, num_key_value_heads=4),
    # vocab, hidden and intermediate sizes do not divide by 4: their FSDP2 shards are padded
    "odd": replace(
        TINY,
        vocab_size=301,
        hidden_size=50,
        intermediate_size=102,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
    ),
}


def _state_bytes(model, opt) -> dict[str, int]:
    """Bytes of the parameters, their .grad and AdamW's two moments, on this process.

    Storages, each counted once: FSDP2's padding is in them, and its gradient shards of one
    unit are views of one reduce-scatter output.
    """

    def nbytes(tensors):
        storages = {}
        for t in tensors:
            s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    params = list(model.parameters())  # a tied weight appears once
    return {
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params),
        "optim": nbytes(opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")),
    }


class _Logits(torch.nn.Module):
    """Forward = logits, so that lm_head is used inside forward (where FSDP2 gathers it)."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m.logits(ids)


def _one_step(model, vocab: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(12).remainder(vocab)[None]
    model(ids).float().pow(2).mean().backward()
    opt.step()
    return opt


# ---- (a) parameter, gradient and optimizer bytes -------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_param_shapes_are_the_models(name, fake_world_started):
    from model.qwen3 import Qwen3

    cfg = CONFIGS[name]
    real = {n: tuple(p.shape) for n, p in Qwen3(cfg).named_parameters()}
    assert param_shapes(cfg) == real
    assert sum(torch.Size(s).numel() for s in param_shapes(cfg).values()) == cfg.num_params()


@pytest.mark.parametrize("name", CONFIGS)
def test_state_bytes_equal_allocated_one_gpu(name):
    from model.qwen3 import (
        Qwen3,
    )  # same parameters as transformers' Qwen3ForCausalLM (tests/test_model.py)

    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = _Logits(Qwen3(cfg).float())
    got = _state_bytes(model, _one_step(model, cfg.vocab_size))
    p = plan(cfg, 16, gpus=1, sp=1)
    assert (p.state.params, p.state.grads, p.state.adamw) == (
        got["params"],
        got["grads"],
        got["optim"],
    )
    assert p.state.params == 4 * cfg.num_params()


def _fake_world(world: int) -> dict:
    """In a spawned process: one rank of a fake `world`-rank group (collectives do nothing, shapes
    are real). Returns rank 0's FSDP2 state bytes and the bytes one decoder layer saves for
    backward under Ulysses attention at several sp, also with LoRA adapters (in bf16, as FSDP2's
    param_dtype gathers them)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from model.lora import add_lora
    from model.qwen3 import DecoderLayer, Qwen3, rope_cos_sin
    from model.ulysses import UlyssesAttention

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        out = {"fsdp": {}, "saved": {}}
        for name, cfg in CONFIGS.items():
            torch.manual_seed(0)
            model = _Logits(Qwen3(cfg).float())
            for layer in model.m.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            out["fsdp"][name] = _state_bytes(model, _one_step(model, cfg.vocab_size))

        groups = {1: None, 2: dist.new_group([0, 1]), world: dist.group.WORLD}
        # 4 query heads; kv heads 2 (repeated at sp=4) and 4; LoRA on every linear layer
        for name, lora in [("tiny", None), ("tied", None), *(("tiny", k) for k in LORAS)]:
            cfg, t = CONFIGS[name], 96
            for sp, group in groups.items():
                layer = DecoderLayer(cfg)
                if lora is not None:
                    add_lora(layer, LORAS[lora])
                layer = layer.to(torch.bfloat16)
                if group is not None:
                    layer.self_attn.attn_fn = UlyssesAttention(group)
                x = torch.randn(1, t, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
                cos, sin = rope_cos_sin(cfg, torch.arange(t)[None], torch.bfloat16)
                skip = {a.untyped_storage().data_ptr() for a in (x, cos, sin, *layer.parameters())}
                seen = {}

                def pack(a, skip=skip, seen=seen):
                    s = a.untyped_storage()
                    if s.data_ptr() not in skip:
                        seen[s.data_ptr()] = s.nbytes()
                    return a

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda a: a):
                    layer(x, cos, sin)
                out["saved"][f"{name}/{sp} {lora or ''}".strip()] = sum(seen.values())
        return out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fake_world_started():
    """_fake_world(4) running in a spawned process: requested early, so that its start-up
    (importing torch, FSDP2) overlaps with the tests that run in this process."""
    ex = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    yield ex.submit(_fake_world, 4)
    ex.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def fake_world(fake_world_started):
    return fake_world_started.result(timeout=180)


@pytest.mark.parametrize("name", CONFIGS)
def test_state_bytes_equal_fsdp2_shards(fake_world, name):
    """Rank 0 of 4: every parameter's dim 0 is padded to a multiple of 4, then split."""
    cfg, got = CONFIGS[name], fake_world["fsdp"][name]
    p = plan(cfg, 16, gpus=4, sp=1)
    assert (p.state.params, p.state.grads, p.state.adamw) == (
        got["params"],
        got["grads"],
        got["optim"],
    )
    ceil = sum(-(-s[0] // 4) * torch.Size(s[1:]).numel() for s in param_shapes(cfg).values())
    assert p.state.params == 4 * ceil
    if name == "odd":  # the padding is really there: rank 0 holds more than a quarter
        assert p.state.params // 4 > cfg.num_params() / 4
        assert shard_numel((301, 50), 4) == 76 * 50


SAVED_KEYS = ["tiny/1", "tiny/2", "tiny/4", "tied/1", "tied/2", "tied/4"]
SAVED_KEYS += ["tiny/1 lora", "tiny/4 lora", "tiny/2 lora dropout", "tiny/2 lora q, v"]


@pytest.mark.parametrize("key", SAVED_KEYS)
def test_layer_saved_bytes_equal_autograd(fake_world, key):
    """What model/qwen3.py's DecoderLayer (Ulysses attention for sp > 1) saves, byte for byte.

    Its RMSNorm is the fused kind, the planner's default; the unfused one would save more. With
    LoRA the frozen weights save nothing and each adapter saves its x A^T [t, rank]."""
    name, sp = key.split(" ")[0].split("/")
    lora = LORAS.get(key.partition(" ")[2])
    want = layer_saved_bytes(CONFIGS[name], 96, int(sp), tiled_mlp=False, lora=lora, device="cpu")
    assert sum(want.values()) == fake_world["saved"][key]
    unfused = layer_saved_bytes(
        CONFIGS[name], 96, int(sp), tiled_mlp=False, fused_norm=False, lora=lora
    )
    assert sum(unfused.values()) > fake_world["saved"][key]


# ---- (b) the recipe's memory figures -------------------------------------------------------------
def test_naive_saved_inputs_are_288_gib():
    one = plan(QWEN3_8B, T_1M, gpus=1, sp=1, offload=False)
    assert one.device_kept == one.naive_saved_inputs == 36 * T_1M * 4096 * 2 == 288 * GiB
    # layer L-1's backward holds every input: the 35 below it kept and its own
    layer = [m for m in one.moments if m.layer == 35][0].working
    assert layer[Buffer.KEPT_INPUTS] + layer[Buffer.LAYER_INPUT] == 288 * GiB
    eight = plan(QWEN3_8B, T_1M, gpus=8, sp=8)
    assert eight.device_kept == 0
    assert eight.host.saved_inputs_per_gpu == 36 * 131_072 * 4096 * 2  # 38.6 GB per GPU
    assert eight.host.saved_inputs_per_gpu == pytest.approx(38.6 * GB, rel=0.005)
    assert eight.host.saved_inputs_per_gpu * 8 == 288 * GiB  # pinned, per node


def test_recipe_budget_table():
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8)
    assert round((p.state.params + p.state.grads + p.state.adamw) / GB, 1) == 16.4
    assert (
        0.7 * GB < p.layer.gathered_bytes <= p.gathered_params < 3 * GB
    )  # layer 0: it and the embedding
    # without tiling, the recompute keeps four 131,072 x 12,288 bf16 MLP intermediates (3.2 GB each)
    untiled = layer_saved_bytes(QWEN3_8B, 131_072, 8, tiled_mlp=False)
    assert untiled[Buffer.MLP_INTERMEDIATES] == 4 * 131_072 * 12_288 * 2
    big = plan(QWEN3_8B, T_1M, gpus=8, sp=8, tiled_mlp=False)
    assert big.layer.working_bytes > p.layer.working_bytes + 15 * GB
    assert p.loss.working[Buffer.LM_HEAD_GRAD_ACC] == 151_936 * 4096 * 4  # 2.5 GB
    assert p.fits and p.total < 56.2 * GB  # lighter than the public recipe
    assert not plan(QWEN3_8B, T_1M, gpus=8, sp=8, offload=False, tiled_mlp=False).fits


# ---- (c) FLOPs -----------------------------------------------------------------------------------
def test_flops_match_the_recipe():
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8)
    assert p.flops.full_recompute == pytest.approx(1.52e18, rel=0.01)
    assert p.flops.no_attn_recompute == pytest.approx(1.2e18, rel=0.01)
    assert p.flops.step_time_s == pytest.approx(192, abs=1)  # at 989 TFLOP/s on 8 GPUs
    assert p.flops.no_attn_recompute_time_s == pytest.approx(151, abs=1)
    assert plan(QWEN3_8B, T_1M, gpus=8, sp=8, mfu=0.5).flops.step_time_s == pytest.approx(
        2 * p.flops.step_time_s
    )
    two_rows = plan(QWEN3_8B, T_1M, gpus=16, sp=8)  # dp=2: twice the FLOPs, twice the GPUs
    assert two_rows.flops.full_recompute == 2 * p.flops.full_recompute
    assert two_rows.flops.step_time_s == pytest.approx(p.flops.step_time_s)


# ---- (d) the longest sequence --------------------------------------------------------------------
def test_max_seq_len_qwen3_8b():
    kw = dict(gpus=8, sp=8, gpu_mem_gb=80)
    n = max_seq_len(QWEN3_8B, **kw)  # model/qwen3.py's fused RMSNorm, the default
    assert n == max_seq_len(QWEN3_8B, fused_norm=True, **kw)
    assert n >= 4 * 2**20 and n % (1024 * 8) == 0
    assert plan(QWEN3_8B, n, **kw).fits
    assert not plan(QWEN3_8B, n + 1024 * 8, **kw).fits
    # An autograd-only RMSNorm (transformers': fp32 copy of every norm input saved) costs about a
    # third of that
    assert 2 * 2**20 < max_seq_len(QWEN3_8B, fused_norm=False, **kw) < n
    # Host memory binds too: the offload pool pins each layer input in blocks of n/64 rounded down
    # to a power of two (at most 64 MiB), so the pinned bytes are within 1/64 of the requested ones.
    capped = max_seq_len(QWEN3_8B, host_mem_gb=1000, **kw)
    assert capped < n and plan(QWEN3_8B, capped, host_mem_gb=1000, **kw).fits_host
    assert not plan(QWEN3_8B, capped + 8192, host_mem_gb=1000, **kw).fits_host
    three = plan(
        QWEN3_8B, 3 * 2**20, **kw
    )  # 3 GiB (3.2 GB) of layer input per GPU: 48 blocks of 64 MiB
    assert three.host.saved_inputs_per_gpu == 36 * 3 * GiB
    assert three.host.offload_bytes_per_step == 2 * 36 * 393_216 * 4096 * 2
    for nbytes in (1, 511, 513, 1000, 3 * 2**20 + 7, 10**9 + 1, 3 * GiB, 5 * GiB + 12345):
        got = host_bytes_for(nbytes)
        assert nbytes <= got and (
            got <= 1.02 * nbytes or nbytes < 64 * 512
        )  # 512 B blocks below 32 KiB
        block = min(64 * 2**20, max(512, 2 ** math.floor(math.log2(max(1, nbytes // 64)))))
        assert got == math.ceil(nbytes / block) * block
    assert max_seq_len(QWEN3_8B, gpus=1, sp=1, gpu_mem_gb=16) == 0  # the fp32 state alone is 131 GB


# ---- (e) bad inputs ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(gpus=8, sp=3), r"sp=3 does not divide the 8 processes"),
        (
            dict(gpus=8, sp=8, seq_len=1004),
            r"seq_len \(1004\) must be a positive multiple of sp \(8\)",
        ),
        (dict(gpus=8, sp=4, dp=3), r"dp x sp must equal"),
        (
            dict(gpus=24, sp=12),
            r"sp=12 spans nodes but is not a multiple of the 8 processes of a node",
        ),
        (dict(gpus=8, sp=8, mfu=1.5), r"mfu"),
        (dict(gpus=8, sp=8, loss_chunk=0), r"loss_chunk must be positive"),
        (dict(gpus=6, sp=6, seq_len=6 * 2**17), r"32 query heads do not divide by sp=6"),
        (
            dict(
                gpus=8,
                sp=8,
                config=replace(QWEN3_8B, num_attention_heads=20, num_key_value_heads=4),
            ),
            r"20 query heads do not divide by sp=8",
        ),
        (
            dict(
                gpus=4,
                sp=4,
                config=replace(QWEN3_8B, num_attention_heads=12, num_key_value_heads=6),
            ),
            r"6 kv heads can neither be split over sp=4 nor repeated",
        ),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    cfg = kwargs.pop("config", QWEN3_8B)
    seq_len = kwargs.pop("seq_len", T_1M)
    with pytest.raises(ValueError, match=match):
        plan(cfg, seq_len, **kwargs)


def test_kv_heads_repeat_when_sp_exceeds_them():
    cfg = replace(QWEN3_8B, num_key_value_heads=4)  # sp=8 > 4 kv heads: each is repeated twice
    saved = layer_saved_bytes(cfg, 131_072, 8)
    q, kv = (
        T_1M * 4 * 128 * 2,
        T_1M * 1 * 128 * 2,
    )  # per rank: 4 query heads, 1 kv head, whole sequence
    assert saved[Buffer.QKV_AT_SDPA] == q + 2 * kv


# ---- (f) the outputs and the command line --------------------------------------------------------
def test_format_and_dict():
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8, model="qwen3-8b")
    text = format_plan(p)
    for s in (
        "fp32 parameter shards",
        "AdamW states",
        "gathered bf16 parameters",
        "host memory per node",
        "1.521e+18",
        "longest sequence that fits",
        "public recipe",
        "380 s",
        "56.2 GB",
        "288 GiB",
    ):
        assert s in text, s
    d = plan_to_dict(p, longest=True)
    json.dumps(d)
    assert d["state"]["params"] == p.state.params and d["max_seq_len"] > T_1M and d["fits"]


def _cli_process(*args):
    """`python -m memory.report ARGS` in a new process."""
    return subprocess.run(
        [sys.executable, "-m", "memory.report", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _cli(*args):
    """memory/report.py's main(ARGS) in this process, its output and exit code as
    _cli_process's (a new process pays torch's import, 3.5 s here, for each of a dozen calls)."""
    import contextlib
    import io

    from memory.report import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's errors: exit 2 after one line on stderr
            code = e.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_cli_table_json_errors(tmp_path):
    r = _cli_process("--model", "qwen3-8b", "--seq-len", "1048576", "--gpus", "8", "--sp", "8")
    assert r.returncode == 0, r.stderr
    assert (
        "peak = held + max" in r.stdout and "public recipe" in r.stdout and "1.521e+18" in r.stdout
    )
    assert "fused RMSNorm" in r.stdout and "[--unfused-norm: " in r.stdout
    u = _cli("--seq-len", "1048576", "--unfused-norm", "--json")
    assert u.returncode == 0, u.stderr
    d = json.loads(u.stdout)
    assert (
        d["options"]["fused_norm"] is False
        and d["total"] > plan(QWEN3_8B, T_1M, gpus=8, sp=8).total
    )

    (tmp_path / "config.json").write_text(json.dumps(Qwen3Config.preset("qwen3-0.6b").to_hf()))
    r = _cli(
        "--model",
        str(tmp_path),
        "--seq-len",
        "65536",
        "--gpus",
        "2",
        "--no-offload",
        "--no-tiled-mlp",
        "--loss-chunk",
        "512",
        "--gpu-mem-gb",
        "40",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (
        d["layout"]["sp"] == 2
        and d["gb_per_gpu"]["saved_gpu"] > 0
        and d["options"]["loss_chunk"] == 512
        and d["max_seq_len"] > 0
    )

    r = _cli("--gpus", "8", "--sp", "3")
    assert r.returncode == 2 and "sp=3 does not divide the 8 processes" in r.stderr
    r = _cli("--model", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no Hugging Face config" in r.stderr


# ---- (g) attention once: save_attention ----------------------------------------------------------
def test_save_attention_flops_are_one_attention_forward_less():
    """1.52e18 -> 1.20e18 at the recipe: the recompute skips exactly one causal attention forward
    per layer, 2 products x T^2/2 x heads x head_dim x 2 FLOPs each."""
    on = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=True)
    off = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=False)
    assert on.flops.step == on.flops.no_attn_recompute == pytest.approx(1.20e18, rel=0.01)
    assert off.flops.step == off.flops.full_recompute == pytest.approx(1.52e18, rel=0.01)
    assert off.flops.step - on.flops.step == pytest.approx(
        36 * 2 * 2 * T_1M**2 / 2 * 32 * 128, rel=1e-12
    )
    assert on.flops.step_time_s == pytest.approx(
        151, abs=1
    ) and off.flops.step_time_s == pytest.approx(192, abs=1)
    assert on.flops.step_time_s == pytest.approx(on.flops.step / (8 * 989e12), rel=1e-12)


def test_save_attention_host_bytes_are_the_pools():
    """Host memory per GPU: L-1 layers' input, out [T, nh/sp, hd] and fp32 lse [nh/sp, T], each
    laid out in the pool's blocks (model/host_pool.py host_bytes_for, rounded per tensor); the
    last layer's three stay on the device and show up in the loss phase."""
    from model.attention import saved_attention_bytes

    for T in (T_1M, 3 * T_1M + 8 * 1024 * 5):  # powers of two, and lengths the blocks round up
        on = plan(QWEN3_8B, T, gpus=8, sp=8, save_attention=True)
        off = plan(QWEN3_8B, T, gpus=8, sp=8)
        t = T // 8
        x, out, lse = (
            t * 4096 * 2,
            T * 4 * 128 * 2,
            4 * T * 4,
        )  # [t, H], [T, 32/8, 128] bf16, [32/8, T] fp32
        assert out + lse == saved_attention_bytes(T, 32, 128, 2, sp=8)
        assert on.host.saved_attention_per_gpu == 35 * (host_bytes_for(out) + host_bytes_for(lse))
        assert on.host.saved_inputs_per_gpu == 35 * host_bytes_for(x)
        assert (
            off.host.saved_inputs_per_gpu == 36 * host_bytes_for(x)
            and off.host.saved_attention_per_gpu == 0
        )
        assert on.host.per_node - off.host.per_node == 8 * (
            35 * (host_bytes_for(out) + host_bytes_for(lse)) - host_bytes_for(x)
        )
        assert on.host.offload_bytes_per_step == 2 * 35 * (x + out + lse)
        assert on.device_kept == x + out + lse and off.device_kept == 0
        assert on.loss.working[Buffer.KEPT_ATTENTION] == out + lse
        assert on.held.bytes == off.held.bytes
    at_1m = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=True)
    assert at_1m.host.saved_attention_per_gpu == 35 * (
        2**30 + 2**24
    )  # 1 GiB + 16 MiB per layer per GPU


def test_save_attention_without_offload_stays_on_the_gpu():
    on = plan(QWEN3_8B, T_1M, gpus=8, sp=8, offload=False, save_attention=True)
    off = plan(QWEN3_8B, T_1M, gpus=8, sp=8, offload=False)
    assert on.host.saved_attention_per_gpu == 0 and on.host.per_node == off.host.per_node
    # the loss holds every layer's; layer L-1's backward the 35 below it (it counts its own)
    assert on.loss.working[Buffer.KEPT_ATTENTION] == 36 * (2**30 + 2**24)
    top = [m for m in on.moments if m.layer == 35][0].working
    assert top[Buffer.KEPT_ATTENTION] == 35 * (2**30 + 2**24)
    assert on.total - off.total >= 35 * (2**30 + 2**24)


def test_pool_pins_what_the_plan_says():
    """A real Qwen3 on CPU through apply_offload(save_attention=True): the pool's pinned bytes
    and device-to-host bytes of one step are the planner's, with min_bytes keeping small tensors
    home."""
    from model.checkpoint_offload import apply_offload
    from model.qwen3 import Qwen3

    cfg = replace(TINY, num_hidden_layers=3)
    T = 256
    for save, min_bytes in (
        (True, 0),
        (False, 0),
        (True, 16 * 1024),
    ):  # lse (4 KiB) below 16 KiB stays
        torch.manual_seed(0)
        model = Qwen3(cfg)
        pool = apply_offload(model, min_bytes=min_bytes, save_attention=save)
        model(torch.randint(0, cfg.vocab_size, (1, T))).square().sum().backward()
        s = pool.reset_step()
        p = plan(
            cfg,
            T,
            gpus=1,
            sp=1,
            compute_bytes=4,
            save_attention=save,
            offload_min_bytes=min_bytes,
            device="cpu",
        )
        assert s.pinned_bytes == p.host.saved_inputs_per_gpu + p.host.saved_attention_per_gpu, (
            save,
            min_bytes,
        )
        assert 2 * s.d2h_bytes == p.host.offload_bytes_per_step, (save, min_bytes)
    # three layers' lse kept on the device, and the last layer's out: the loss holds them all
    assert p.loss.working[Buffer.KEPT_ATTENTION] == 3 * 4 * T * 4 + T * 4 * 32 * 4


@pytest.mark.parametrize(
    "save,min_bytes",
    [(False, 0), (True, 0), (True, 16 * 1024)],  # lse [1, 2, 256] fp32 (2 KiB) below 16 KiB stays
)
def test_train_reserves_the_host_blocks_the_plan_counts(save, min_bytes, monkeypatch):
    """run/build.py's reserve_host_blocks pins before step 1 exactly the host blocks its run's
    plan counts (HostMemory), and lays them out for the bytes the plan has a step copy to the
    host: 255 tokens over sp=2, padded to 256, with and without attention once."""
    import train
    from memory.choices import plan_for_run
    from model.host_pool import HostPool
    from run import build

    monkeypatch.setattr(build.dist, "get_rank", lambda: 0)  # no process group in this test
    mc = replace(TINY, num_hidden_layers=3)
    run = train.TrainConfig(seq_len=255, offload_min_bytes=min_bytes, save_attention=save)
    p = plan_for_run(run, mc, 2, 2, 1, torch.float32, "cpu")
    pool = HostPool(min_bytes=min_bytes)
    build.reserve_host_blocks(pool, run, mc, 2, torch.float32, "cpu", p.placements)
    s = pool.stats()
    assert s.pinned_bytes == p.host.saved_inputs_per_gpu + p.host.saved_attention_per_gpu > 0
    assert 2 * s.pool_bytes == p.host.offload_bytes_per_step
    assert p.options.save_attention == save
    assert (p.host.saved_attention_per_gpu > 0) == any(x.attention == "host" for x in p.placements)


def test_longest_rows_with_and_without_attention_once():
    """Every layer keeping its attention, the longest row is shorter (host-bound) than
    recomputing it; the chooser keeps it on every layer up to that row, and past it on fewer."""
    kw = dict(gpus=8, sp=8, gpu_mem_gb=80, host_mem_gb=2000)
    n_on = max_seq_len(QWEN3_8B, save_attention=True, **kw)
    n_off = max_seq_len(QWEN3_8B, save_attention=False, **kw)
    assert T_1M < n_on < n_off
    assert plan(QWEN3_8B, n_on, save_attention=True, **kw).fits
    past = plan(QWEN3_8B, n_on + 8192, save_attention=True, **kw)
    assert past.fits_gpu and not past.fits_host  # host memory is what stops attention once
    # past n_on the chooser still keeps every attention, one layer's input moving to the GPU to
    # make host room; further on, some layers recompute theirs
    rows = (n_on, n_on + 8192, (n_on + n_off) // 2 // 8192 * 8192)
    at, beyond, between = (choose_layout(QWEN3_8B, n, **kw).chosen.plan for n in rows)
    device_inputs = [sum(x.input == "device" for x in q.placements) for q in (at, beyond)]
    assert at.recomputed_layers == beyond.recomputed_layers == 0 and device_inputs == [1, 2]
    assert 0 < between.recomputed_layers < 36 and between.fits
    unlimited = choose_layout(QWEN3_8B, rows[2], **{**kw, "host_mem_gb": None})
    assert unlimited.chosen.plan.recomputed_layers == 0


def test_plan_for_run_follows_the_layout_choice():
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        seq_len=4 * T_1M,
        offload=True,
        offload_min_bytes=2**20,
        tile_mlp=16384,
        loss_chunk=256,
        gpu_mem_gb=80.0,
        host_mem_gb=2000.0,
        model="qwen3-8b",
    )
    auto = plan_for_run(cfg, QWEN3_8B, 8, 8, 1, torch.bfloat16, "cuda")  # no attribute: automatic
    kw = dict(gpus=8, sp=8, dp=1, mlp_tile=16384, offload_min_bytes=2**20, host_mem_gb=2000.0)
    chosen = choose_layout(QWEN3_8B, 4 * T_1M, model="qwen3-8b", **kw).chosen.plan
    assert auto.placements == chosen.placements and auto.fits
    assert auto.options.layout_why.startswith("--layout auto")
    pinned = plan_for_run(
        SimpleNamespace(**vars(cfg), save_attention=True), QWEN3_8B, 8, 8, 1, 2, "cuda"
    )
    assert pinned.recomputed_layers == 0  # --save-attention: every layer keeps its attention
    short = plan_for_run(
        SimpleNamespace(**{**vars(cfg), "seq_len": T_1M}, save_attention=None),
        QWEN3_8B,
        8,
        8,
        1,
        2,
        "cuda",
    )
    assert short.options.save_attention and short.flops.step == short.flops.no_attn_recompute


def test_dry_run_shows_both_variants():
    text = format_plan(plan(QWEN3_8B, T_1M, gpus=8, sp=8, host_mem_gb=2000, save_attention=True))
    n_on = max_seq_len(QWEN3_8B, gpus=8, sp=8, host_mem_gb=2000, save_attention=True)
    n_off = max_seq_len(QWEN3_8B, gpus=8, sp=8, host_mem_gb=2000, save_attention=False)
    for s in (
        "kept (attention once) <- this run",
        "recomputed",
        "1.197e+18",
        "1.521e+18",
        f"{n_on:,}",
        f"{n_off:,}",
        f"every layer keeps its attention up to {n_on:,} tokens",
    ):
        assert s in text, s
    r = _cli("--seq-len", str(4 * T_1M), "--host-mem-gb", "2000")
    assert r.returncode == 0, r.stderr
    mixed = "this run: inputs 34 host, 2 device; attention 22 host, 1 device, 13 recomputed"
    assert f"{mixed} (--layout auto: the fastest that fits)" in r.stdout
    d = json.loads(_cli("--seq-len", str(4 * T_1M), "--save-attention", "--json").stdout)
    assert d["options"]["save_attention"] is True and d["fits"] is False
    assert d["max_seq_len_by_save_attention"] == {"true": n_on, "false": n_off}


# ---- CPU offload (FSDP2 CPUOffloadPolicy): the fp32 state in host memory -------------------------
def _pow2(n: int) -> int:
    """torch's pinned host allocator: the next power of two at or above n."""
    return 2 ** math.ceil(math.log2(n))


def test_cpu_offload_moves_the_state_to_host():
    from model.qwen3 import Qwen3

    kw = dict(
        gpus=8,
        sp=8,
        host_mem_gb=2000,
        save_attention=False,
        mlp_tile=16384,
        offload_min_bytes=2**20,
    )
    off, on = plan(QWEN3_8B, T_1M, **kw), plan(QWEN3_8B, T_1M, cpu_offload=True, **kw)
    with torch.device("meta"):
        shapes = [p.shape for p in Qwen3(QWEN3_8B).parameters()]
    rows = [
        -(-s[0] // 8) * math.prod(s[1:]) for s in shapes
    ]  # rank 0's padded shard of each parameter
    # host per GPU: parameter and gradient shards pinned one buffer each, the two AdamW moments
    # pageable
    state = sum(2 * _pow2(4 * n) + 2 * 4 * n for n in rows)
    assert on.host.cpu_state_per_gpu == state and on.host.per_node - off.host.per_node == 8 * state
    assert (
        1.1 < state / (16 * sum(rows)) < 1.25
    )  # the rounding costs 10-25% over the 16 B per parameter
    assert (
        off.held.bytes - on.held.bytes == 3 * 4 * sum(rows)
        and Buffer.GRAD_SHARDS not in on.layer.working
    )
    # the GPU keeps one unit's fp32 shards on their way in and one unit's gradient shards on
    # their way out
    layer = sum(rows[1:12])  # rows[0] is the embedding, then layer 0's 11 parameters
    cpu_offload_buffers = (Buffer.STAGED_SHARDS, Buffer.STAGED_GRADS)
    staged = {k: v for k, v in on.layer.working.items() if k in cpu_offload_buffers}
    assert list(staged.values()) == [4 * layer, 4 * layer]
    cpu = plan(QWEN3_8B, T_1M, cpu_offload=True, device="cpu", **kw)
    assert not any(k in cpu_offload_buffers for k in cpu.layer.working)
    # PCIe: every unit's shards in for each gather (twice, but once for the last layer and the
    # [norm + lm_head] unit, which stay gathered from forward to backward), every gradient shard out
    head = rows[-1] + rows[-2]
    assert on.cpu_offload_cost.transfer_bytes_per_step == 4 * (
        2 * sum(rows) - layer - head
    ) + 4 * sum(rows)
    assert on.cpu_offload_cost.adamw_bytes_per_node == 8 * 23 * 4 * sum(
        rows
    ) and on.cpu_offload_cost.adamw_time_s == pytest.approx(
        on.cpu_offload_cost.adamw_bytes_per_node / 200e9
    )
    assert (
        off.host.cpu_state_per_gpu
        == off.cpu_offload_cost.transfer_bytes_per_step
        == off.cpu_offload_cost.adamw_bytes_per_node
        == 0
    )
    # what CPU offload is for, projected at the recipe: <= 30 GB per GPU, and >= 5,242,880 tokens
    # on 8 x 80 GB
    assert on.total <= 30 * GB < off.total
    assert max_seq_len(QWEN3_8B, cpu_offload=True, **kw) >= 5_242_880 > max_seq_len(QWEN3_8B, **kw)


def test_cpu_offload_through_plan_for_run_cli_and_table():
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        seq_len=T_1M,
        offload=True,
        offload_min_bytes=2**20,
        tile_mlp=16384,
        loss_chunk=256,
        gpu_mem_gb=80.0,
        host_mem_gb=2000.0,
        model="qwen3-8b",
        cpu_offload=True,
    )
    p = plan_for_run(cfg, QWEN3_8B, 8, 8, 1, torch.bfloat16, "cuda")
    assert p.options.cpu_offload and p.host.cpu_state_per_gpu > 0
    assert not plan_for_run(
        SimpleNamespace(**{**vars(cfg), "cpu_offload": False}), QWEN3_8B, 8, 8, 1, 2, "cuda"
    ).options.cpu_offload
    text = format_plan(p)
    assert "in host memory (CPU offload)" in text and "with --no-cpu-offload" in text
    assert "with --cpu-offload" in format_plan(plan(QWEN3_8B, T_1M, gpus=8, sp=8, host_mem_gb=2000))
    d = json.loads(_cli("--cpu-offload", "--json").stdout)
    assert d["options"]["cpu_offload"] is True and d["gb_per_gpu"]["total"] < 30


# ---- outside the allocator, flash's GQA expansion, the prefetched attention, 2^31 elements ------
def test_context_and_nccl_are_kept_free():
    """fits_gpu keeps the CUDA context and one NCCL communicator's buffers per group (FSDP2's over
    all GPUs, Ulysses' own with sp > 1) free besides the peak and the reserve; a CPU plan none."""
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=True)
    assert p.communicators == 2 and p.outside_allocator == int((0.75 + 2 * 1.6) * GB)
    assert plan(QWEN3_8B, T_1M, gpus=8, sp=1).communicators == 1  # dp=8: FSDP2's group only
    assert plan(QWEN3_8B, 65_536, gpus=1, sp=1).outside_allocator == int(0.75 * GB)
    assert plan(TINY, 4096, gpus=2, sp=2, device="cpu").outside_allocator == 0
    edge = (p.total + p.options.reserve_gb * GB) / GB + 1.0  # room for the peak and reserve only
    kw = dict(gpus=8, sp=8, save_attention=True)
    assert not plan(QWEN3_8B, T_1M, gpu_mem_gb=edge, **kw).fits_gpu
    assert plan(QWEN3_8B, T_1M, gpu_mem_gb=edge + 3.0, **kw).fits_gpu


def test_flash_backward_expands_dk_dv_to_the_query_heads():
    """aten's flash backward (mha_bwd) allocates dk and dv at the query heads when there are fewer
    kv heads, [T, nh/sp, hd] each in the compute dtype, and sums them down at the end: 2 GiB per GPU
    at the recipe (4 query heads on 1 kv head per rank). cuDNN's backward takes the kv heads as
    they are; a model with as many kv heads as query heads expands nothing."""
    kw = dict(gpus=8, sp=8, save_attention=True)
    cudnn = plan(QWEN3_8B, T_1M, **kw)
    flash = plan(QWEN3_8B, T_1M, attn_backend="flash", **kw)
    key = Buffer.FLASH_GQA_GRADS
    expanded = 2 * T_1M * (32 // 8) * 128 * 2
    assert expanded == 2 * GiB
    at_attention = [m for m in flash.moments if m.name == "attention backward"]
    # layers 35, 34 (the first of the run placed on the host), 1 and 0
    assert len(at_attention) == 4 and all(m.working[key] == expanded for m in at_attention)
    assert all(key not in m.working for m in flash.moments if m.name != "attention backward")
    assert all(key not in m.working for m in cudnn.moments)
    assert flash.layer.name == "attention backward" and flash.total > cudnn.total
    mha = replace(QWEN3_8B, num_key_value_heads=32)
    assert all(key not in m.working for m in plan(mha, T_1M, attn_backend="flash", **kw).moments)
    on_cpu = plan(TINY, 4096, gpus=2, sp=2, attn_backend="flash", device="cpu")
    assert all(key not in m.working for m in on_cpu.moments)
    assert (
        3_700_000
        < max_seq_len(QWEN3_8B, gpus=8, sp=8, attn_backend="flash")
        < max_seq_len(QWEN3_8B, gpus=8, sp=8)
    )


def test_next_layers_attention_is_prefetched_with_its_input():
    """Attention once: the pool starts the copies back of layer i-1's input, out and lse together
    when layer i's recompute begins, so every layer's backward but layer 0's holds them."""
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=True)
    ahead = {m.layer: m.working.get(Buffer.NEXT_ATTENTION, 0) for m in p.moments if m.layer}
    kept = 2**30 + 2**24  # out [T, 4, 128] bf16 + lse fp32
    assert ahead == {35: kept, 34: kept, 1: kept}
    assert all(Buffer.NEXT_ATTENTION not in m.working for m in p.moments if m.layer == 0)
    for q in (
        plan(QWEN3_8B, T_1M, gpus=8, sp=8),
        plan(QWEN3_8B, T_1M, gpus=8, sp=8, offload=False, save_attention=True),
    ):
        assert all(Buffer.NEXT_ATTENTION not in m.working for m in q.moments)


def test_attention_past_2_31_elements_is_flagged_unverified():
    """A rank's q holds T x heads/sp x head_dim elements: 2^31 at 4,194,304 tokens over sp=8."""
    from memory.report import plan_warnings

    at, past = 4_194_304, 4_194_304 + 8192
    assert plan(QWEN3_8B, at, gpus=8, sp=8).attention_elements == 2**31
    assert not any("2^31" in w for w in plan_warnings(plan(QWEN3_8B, at, gpus=8, sp=8)))
    warned = plan_warnings(plan(QWEN3_8B, past, gpus=8, sp=8))
    assert any(f"{past * 4 * 128:,} elements" in w and "unverified on GPU" in w for w in warned)
    r = _cli("--seq-len", str(past))
    assert r.returncode == 0 and "unverified on GPU" in r.stdout
    d = json.loads(_cli("--seq-len", str(past), "--json").stdout)
    assert d["attention_elements"] == past * 4 * 128 and len(d["warnings"]) == 2
    # planned before train.py's probe (auto): what flash would add is said; a pinned kernel: not
    assert "should it fail train.py's probe" in _cli("--seq-len", str(T_1M)).stdout
    assert "should it fail" not in _cli("--seq-len", str(T_1M), "--attn-backend", "cudnn").stdout


@pytest.mark.parametrize(
    ("hidden", "intermediate", "dtype"),
    # the experts wider than the hidden size (autograd through the experts is the tile's peak),
    # and narrower (the routing weights' fp32 gradient temporaries are), in fp32 and bf16
    [(64, 768, torch.float32), (64, 768, torch.bfloat16), (256, 96, torch.bfloat16)],
)
def test_moe_backward_terms_equal_the_meter(hidden, intermediate, dtype):
    """model/moe.py's backward on one block, measured by the CPU meter, against the MoE terms of
    layer_backward_moments' "MLP backward": the routing, one tile, the accumulators, the input
    gradient and the experts' stacked gradients. The planner spreads an expert's pairs evenly;
    real routing is uneven, so the plan is taken at the tokens whose even spread is the busiest
    expert's pairs (the tile that makes the peak)."""
    from memory.meter import StepMeter
    from model.moe import SparseMoeBlock, route

    experts, top_k, tokens = 4, 2, 2048
    torch.manual_seed(0)
    block = SparseMoeBlock(hidden, intermediate, experts, top_k, True).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    y = block(x)
    dy = torch.randn_like(y)
    meter = StepMeter(torch.device("cpu"), model=block, baseline=[x, y, dy])
    with meter:
        y.backward(dy)
    with torch.no_grad():
        chosen = route(x.reshape(-1, hidden), block.gate.weight, top_k, True)[1]
    busiest = int(torch.bincount(chosen.reshape(-1), minlength=experts).max())
    config = replace(
        TINY,
        hidden_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=intermediate,
    )
    b = torch.finfo(dtype).bits // 8
    at_busiest, at_tokens = (
        layer_backward_moments(config, t, 1, mlp_tile=block.tile, compute_bytes=b, device="cpu")[
            "MLP backward"
        ]
        for t in (-(-busiest * experts // top_k), tokens)
    )
    planned = at_busiest[Buffer.MOE_TILE] + at_busiest[Buffer.MOE_WEIGHT_GRAD_ACC]
    # the routing, the input-gradient buffer and the experts' stacked gradients: every token's
    terms = (Buffer.MOE_ROUTING, Buffer.MLP_INPUT_GRAD_BUFFER, Buffer.LAYER_GRADS)
    planned += sum(at_tokens[k] for k in terms)
    assert meter.peak_bytes - meter.start_bytes == pytest.approx(planned, rel=0.01)


# ---- (c) Qwen3.5: the hybrid's shapes, saved tensors and FLOPs ----------------------------------
QWEN35 = Qwen3Config.preset("qwen3.5-tiny")
QWEN35_MOE = Qwen3Config.preset("qwen3.5-moe-tiny")


@pytest.mark.parametrize("config", [QWEN35, QWEN35_MOE], ids=["dense", "moe"])
def test_hybrid_param_shapes_are_the_models(config):
    """Every Gated DeltaNet, gated attention and shared-expert parameter under its name, and
    the largest layer (what FSDP2's plan counts gathered) is the largest of the model's."""
    from memory.model_size import fsdp_units
    from model.qwen3_5 import Qwen3_5

    model = Qwen3_5(config)
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert param_shapes(config) == real
    assert sum(math.prod(s) for s in real.values()) == config.num_params()
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    units = fsdp_units(config, 1, 4)
    assert list(units.layers_gathered) == per_layer
    assert units.layer_gathered == max(per_layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_saved_bytes_equal_autograd(dtype):
    """What a Qwen3.5 Gated DeltaNet layer (model/qwen3_5.py's HybridLayer, its MLP untiled)
    saves for backward, byte for byte, at a row of 2,560 tokens (3 delta-rule blocks: 2 saved
    states). Leaving out the conv's shifted products (3 x [t, C]) or the gated norm's fp32
    upcasts would be 35-45% short."""
    from model.qwen3_5 import HybridLayer

    t = 2560
    layer = HybridLayer(QWEN35, 0).to(dtype)
    x = torch.randn(1, t, QWEN35.hidden_size, dtype=dtype, requires_grad=True)
    skip = {a.untyped_storage().data_ptr() for a in (x, *layer.parameters())}
    seen = {}

    def pack(a):
        s = a.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return a

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda a: a):
        layer(x, None, None)
    b = torch.finfo(dtype).bits // 8
    want = layer_saved_bytes(QWEN35, t, 1, tiled_mlp=False, compute_bytes=b, linear=True)
    # A_log's exp and the fp32 decay factor per value head: 2 x [nv] fp32, not counted
    assert sum(want.values()) + 2 * 4 * QWEN35.linear_num_value_heads == sum(seen.values())


@pytest.mark.parametrize("block_chunks", [512, 16])
def test_gdn_flops_are_the_chunk_forms_and_the_scans_products(monkeypatch, block_chunks):
    """memory/model_size.py's delta-rule count against torch's flop counter on
    model/delta_rule.py at 4,096 tokens (64 chunks) and dk = dv = 64, in one block and in four:
    the forward and the backward within 1%. Leaving out the scan's compositions is 29% short;
    counting the backward as 3 forwards alone (without the inverse's gradient) 2.5%."""
    from torch.utils.flop_counter import FlopCounterMode

    import memory.model_size as model_size
    import model.delta_rule as dr

    monkeypatch.setattr(dr, "BLOCK_CHUNKS", block_chunks)
    monkeypatch.setattr(model_size, "BLOCK_CHUNKS", block_chunks)
    nk, nv, dk, dv, t = 2, 4, 64, 64, 4096
    c = replace(QWEN35, linear_num_key_heads=nk, linear_num_value_heads=nv)
    c = replace(c, linear_key_head_dim=dk, linear_value_head_dim=dv)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, t, nk, dk, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(1, t, nv, dv, generator=g, requires_grad=True)
    gate = (-torch.rand(1, t, nv, generator=g)).requires_grad_()
    beta = torch.rand(1, t, nv, generator=g).requires_grad_()
    with FlopCounterMode(display=False) as fwd:
        out = dr.gated_delta_rule(q, k, v, gate, beta)
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    want_fwd, want_bwd = model_size.gdn_flops(c, t)
    print(f"forward {fwd.get_total_flops():.4e} (planned {want_fwd:.4e}), backward "
          f"{bwd.get_total_flops():.4e} ({want_bwd:.4e})")  # fmt: skip
    assert fwd.get_total_flops() == pytest.approx(want_fwd, rel=0.01)
    assert bwd.get_total_flops() == pytest.approx(want_bwd, rel=0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gdn_block_working_set_is_the_meters(dtype):
    """The delta rule's backward working set (Buffer.GDN_BLOCK, in the "Gated DeltaNet delta rule
    backward" moment) against the CPU meter over model/delta_rule.py's backward at dk = dv = 128,
    4 value heads, 8,192 tokens (one block of 128 chunks): what the backward allocates above its
    inputs, output gradient and the zeroed input gradients, within 2%. Leaving out the scan's maps
    is 51% short."""
    from memory.meter import StepMeter
    from model.delta_rule import gated_delta_rule

    nk, nv, d, t = 2, 4, 128, 8192
    c = replace(QWEN35, linear_num_key_heads=nk, linear_num_value_heads=nv)
    c = replace(c, linear_key_head_dim=d, linear_value_head_dim=d)
    b = torch.tensor([], dtype=dtype).element_size()
    moments = layer_backward_moments(c, t, 1, compute_bytes=b, device="cpu", linear=True)
    planned = moments["Gated DeltaNet delta rule backward"][Buffer.GDN_BLOCK]
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, t, nk, d, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(1, t, nv, d, generator=gen).to(dtype)
    g = -0.1 * torch.rand(1, t, nv, generator=gen)
    beta = torch.rand(1, t, nv, generator=gen).to(dtype)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    out = gated_delta_rule(*inputs)
    grad_out = torch.randn(out.shape, generator=gen).to(out.dtype)
    with StepMeter("cpu", baseline=[*inputs, out, grad_out]) as meter:
        out.backward(grad_out)
    grads = sum(x.grad.numel() * x.grad.element_size() for x in inputs)
    measured = meter.peak_bytes - meter.start_bytes - grads
    print(f"{dtype}: measured {measured / 1e6:.1f} MB, planned {planned / 1e6:.1f} MB")
    assert planned == pytest.approx(measured, rel=0.02)


def test_hybrid_attention_flops_count_attention_layers_only():
    """Qwen3.5-9B at 1M tokens: attention on its 8 full-attention layers only (16 heads of
    256), the delta rule on its 24 others; a plan keeping attention counts it on those 8."""
    from memory.model_size import gdn_flops, step_flops

    c = Qwen3Config.preset("qwen3.5-9b")
    f = step_flops(c, T_1M)
    assert f["attention_fwd"] == 8 * 2 * T_1M * T_1M * 16 * 256
    # per token and value head: the chunk form's 212,992 and the scan's 322,816 at 1M tokens
    assert f["gdn_fwd"] == 24 * 32 * 535_808 * T_1M == 24 * gdn_flops(c, T_1M)[0]
    assert f["gdn_bwd"] == 24 * (3 * 32 * 535_808 + 32 * 2 * 64 * 64) * T_1M
    once = plan(c, T_1M, gpus=8, sp=8, save_attention=True)
    again = plan(c, T_1M, gpus=8, sp=8)
    assert again.flops.step - once.flops.step == f["attention_fwd"]
    assert once.recomputed_layers == 0 and again.recomputed_layers == 8


def test_gdn_layers_keep_no_attention():
    """A Gated DeltaNet layer has no attention to keep: a plan told to keep every layer's keeps
    the attention layers' only, on the host as the pool pins it (model/checkpoint_offload.py's
    offloaded_tensors counts them alike), and its FLOPs drop by the attention layers'."""
    from model.checkpoint_offload import offloaded_tensors

    c = Qwen3Config.preset("qwen3.5-9b")
    p = plan(c, T_1M, gpus=8, sp=8, save_attention=True)
    kept = [x.attention for x in p.placements]
    assert [kept[i] for i in range(32) if c.is_linear_layer(i)] == ["recompute"] * 24
    assert [kept[i] for i in range(32) if not c.is_linear_layer(i)] == ["host"] * 7 + ["device"]
    kinds = offloaded_tensors(c, T_1M, 8, dtype=torch.bfloat16, save_attention=True)
    assert [k.count for k in kinds] == [31, 7, 7]
    attention = sum(host_bytes_for(k.nbytes) * k.count for k in kinds[1:])
    assert p.host.saved_attention_per_gpu == attention
