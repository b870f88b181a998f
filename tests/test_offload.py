"""Checkpoint with offload: the same numbers as no wrapper, bytes where they belong.

model/checkpoint_offload.py's wrapper, model/host_pool.py's pool, model/tiled_mlp.py's MLP.
On CPU the whole mechanism runs (host blocks, piecewise copies, backward order, counters, the
bytes a GPU run would pin); FSDP2 runs on 2 gloo processes against one unsharded process. Tests
that take a `device` also run on CUDA when there is one, where they check what only a GPU shows:
device memory after forward, pinned blocks reused from step 1.
"""

import copy
import gc
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

from model.checkpoint_offload import apply_offload, offload_layers, remove_offload
from model.config import Qwen3Config
from model.host_pool import HostPool, host_block_bytes, host_bytes_for
from model.qwen3 import MLP, DecoderLayer, Qwen3, rope_cos_sin
from model.tiled_mlp import set_mlp_tiling, tiled_mlp

CFG = replace(Qwen3Config.preset("tiny"), num_hidden_layers=3)  # 3 layers: a prefetch chain
B, T = 2, 48
X_BYTES = B * T * CFG.hidden_size * 4  # one fp32 layer input


def _block_ref(n: int) -> int:
    """The pool's block size, written out: min(64 MiB, max(512, largest power of 2 <= n // 64))."""
    q, p = n // 64, 1
    while p * 2 <= q:
        p *= 2
    return min(64 << 20, max(512, p))  # q < 2: p = 1, and 512 wins anyway


def _blocks_ref(n: int) -> int:
    return -(-n // _block_ref(n))


X_BLOCKS = _blocks_ref(X_BYTES)  # 24,576 B in 48 blocks of 512 B


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _model(seed: int = 0) -> Qwen3:
    torch.manual_seed(seed)
    m = Qwen3(CFG)
    m.init_weights()
    with torch.no_grad():  # norms away from 1, so a skipped norm would show
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return m


def _ids(seed: int, batch: int = B) -> torch.Tensor:
    return torch.randint(
        0, CFG.vocab_size, (batch, T), generator=torch.Generator().manual_seed(seed)
    )


def _loss(m, ids):
    logits = F.linear(m(ids), m.lm_head.weight)  # [B, T, vocab]
    return F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def _step(m, ids):
    m.zero_grad(set_to_none=True)
    loss = _loss(m, ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def _same(a, b, exact):
    if exact:
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("tile", [None, 5])
def test_wrapped_model_matches_unwrapped(offload, tile):
    ref = _model()
    ids = _ids(1)
    loss0, grads0 = _step(ref, ids)
    m = copy.deepcopy(ref)
    keys = list(m.state_dict())
    pool = apply_offload(m, offload=offload, min_bytes=0, tile_mlp=tile)
    assert list(m.state_dict()) == keys  # nothing inserted into the module tree
    L = CFG.num_hidden_layers
    for step in range(3):
        loss, grads = _step(m, ids)
        _same(loss, loss0, exact=tile is None)  # recompute replays the same ops: bit-exact
        for n in grads0:
            _same(grads[n], grads0[n], exact=tile is None)
        s = pool.reset_step()
        moved = (
            L * X_BYTES if offload else 0
        )  # layers x tokens x hidden x 4 B, each way; no cos/sin
        assert (s.d2h_bytes, s.h2d_bytes) == (moved, moved)
        assert s.prefetched == (L - 1 if offload else 0)  # all but the first recompute prefetched
        assert s.host_allocs == (
            L * X_BLOCKS if offload and step == 0 else 0
        )  # blocks, step 1 only
        assert s.in_use_buffers == 0 and s.pool_bytes == moved
        assert s.pinned_bytes == (L * X_BLOCKS * _block_ref(X_BYTES) if offload else 0)


def test_ten_steps_hold_no_more_buffers():
    m = _model()
    pool = apply_offload(m, min_bytes=0, tile_mlp=32)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    seen, live = [], []
    for step in range(10):
        opt.zero_grad(set_to_none=False)
        _loss(m, _ids(step)).backward()
        opt.step()
        s = pool.reset_step()
        seen.append((s.pool_bytes, s.pool_buffers, s.in_use_buffers, pool.copies_in_flight()))
        assert s.host_allocs == (CFG.num_hidden_layers * X_BLOCKS if step == 0 else 0)
        if step in (1, 9):
            gc.collect()
            live.append(
                sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter))
            )
    assert set(seen) == {
        (CFG.num_hidden_layers * X_BYTES, CFG.num_hidden_layers * X_BLOCKS, 0, 0)
    }, seen
    assert live[0] == live[1]  # no tensor accumulates anywhere from step 2 to step 10


def test_small_and_shared_inputs_stay_put():
    ref, ids = _model(), _ids(2)
    loss0, grads0 = _step(ref, ids)
    m = copy.deepcopy(ref)
    pool = apply_offload(m, min_bytes=X_BYTES + 1)  # x is below the threshold: nothing moves
    loss, grads = _step(m, ids)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads0)
    s = pool.reset_step()
    assert s.d2h_bytes == s.h2d_bytes == s.pool_bytes == s.pinned_bytes == 0
    pool.min_bytes = 0  # cos/sin need no grad: kept by reference even with no size limit
    _step(m, ids)
    assert pool.reset_step().d2h_bytes == CFG.num_hidden_layers * X_BYTES
    with torch.no_grad():  # nothing is saved without grad
        assert torch.equal(m(ids), ref(ids))
    assert pool.reset_step().d2h_copies == 0


def test_hidden_state_passed_by_keyword_goes_to_the_host():
    """checkpoint saves only its positional inputs through the hooks; a layer called with the
    hidden state by keyword still has it moved, and the gradients are those of no wrapper."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(DecoderLayer(CFG) for _ in range(CFG.num_hidden_layers))
    ref = copy.deepcopy(layers)
    x = torch.randn(B, T, CFG.hidden_size, requires_grad=True)
    cos, sin = rope_cos_sin(CFG, torch.arange(T)[None], torch.float32)

    def grads(stack):
        h = x * 1.0  # a non-leaf layer-0 input
        for layer in stack:
            h = layer(x=h, cos=cos, sin=sin)
        return torch.autograd.grad(h.square().sum(), [x, *stack.parameters()])

    g0 = grads(ref)
    pool = apply_offload(layers, min_bytes=0)
    g = grads(layers)
    assert all(torch.equal(a, b) for a, b in zip(g, g0, strict=True))
    s = pool.reset_step()
    L = CFG.num_hidden_layers
    assert (s.d2h_bytes, s.h2d_bytes, s.prefetched) == (L * X_BYTES, L * X_BYTES, L - 1)


def test_transformers_layers_offloaded_and_tiled():
    """transformers' own Qwen3 decoder layers and MLPs (keyword arguments, a tuple of RoPE
    tables), given as a plain list to offload_layers: the loss and gradients of the unwrapped
    transformers model, every layer input through the pool."""
    from hf_ref import hf_model

    ref, ids = hf_model(CFG), _ids(6)

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    loss0, grads0 = step(ref)
    m = copy.deepcopy(ref)
    pool = HostPool(min_bytes=0)
    offload_layers(list(m.model.layers), pool, tile_mlp=5)
    loss, grads = step(m)
    _same(loss, loss0, exact=False)
    for n in grads0:
        _same(grads[n], grads0[n], exact=False)
    s = pool.reset_step()
    L = CFG.num_hidden_layers
    assert (s.d2h_bytes, s.h2d_bytes, s.prefetched) == (L * X_BYTES, L * X_BYTES, L - 1)
    remove_offload(list(m.model.layers))
    assert all("forward" not in layer.__dict__ for layer in m.model.layers)
    assert all("forward" not in layer.mlp.__dict__ for layer in m.model.layers)


def test_replaced_attention_runs_in_forward_and_recompute():
    calls = []

    def eager_attention(q, k, v):  # [B, T, heads, hd] -> [B, T, nh, hd], explicit softmax
        calls.append(q.shape)
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        return torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)

    ref, ids = _model(), _ids(3)
    ref.set_attention(eager_attention)
    loss0, grads0 = _step(ref, ids)
    m = copy.deepcopy(ref)
    apply_offload(m, min_bytes=0)
    calls.clear()
    loss, grads = _step(m, ids)
    assert len(calls) == 2 * CFG.num_hidden_layers  # forward, then recompute in backward
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads0)


def test_retain_graph_remove_and_misuse():
    m, ids = _model(), _ids(4)
    pool = apply_offload(m, min_bytes=0, tile_mlp=16)
    loss = _loss(m, ids)
    loss.backward(retain_graph=True)  # the host copies survive a retained graph
    g1 = {n: p.grad.clone() for n, p in m.named_parameters()}
    loss.backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, 2 * g1[n])
    s = pool.reset_step()
    assert s.h2d_bytes == 2 * s.d2h_bytes > 0  # moved out once, fetched back for each backward
    with pytest.raises(RuntimeError, match="already wrapped"):
        apply_offload(m)
    remove_offload(m)
    assert all(
        "forward" not in layer.__dict__ and "forward" not in layer.mlp.__dict__
        for layer in m.model.layers
    )
    with pytest.raises(TypeError, match="no `model.layers`"):
        apply_offload(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="positive"):
        set_mlp_tiling(m.model.layers[0].mlp, 0)
    pool.close()
    apply_offload(m, pool=pool, min_bytes=0)
    with pytest.raises(RuntimeError, match="closed"):
        _loss(m, ids)


class CountSilu(TorchDispatchMode):
    """Counts aten.silu forward calls: one per MLP tile run (forward, recompute or the
    backward's replay); the untiled MLP runs one per call."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket is torch.ops.aten.silu
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("offload", [False, True])
def test_recompute_skips_the_tile_loop(offload, monkeypatch):
    """In checkpoint's recompute a tiled MLP only saves its input: its tiles run in forward and
    in its backward's replay, not in the recompute, and the gradients are bit-equal to a recompute
    that runs them (TiledForward.skipping replaced by a no-op)."""
    import contextlib

    import model.tiled_mlp as tiled

    tile, L = 16, CFG.num_hidden_layers
    tiles = -(-B * T // tile)  # 96 rows: 6 tiles per layer call
    ref, ids, got = _model(), _ids(4), {}
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(
                tiled.TiledForward, "skipping", lambda self: contextlib.nullcontext()
            )
        m = copy.deepcopy(ref)
        apply_offload(m, offload=offload, min_bytes=0, tile_mlp=tile)
        with CountSilu() as c:
            got[skip] = _step(m, ids)
        assert c.calls == (2 if skip else 3) * L * tiles, (skip, c.calls)
    assert torch.equal(got[True][0], got[False][0])
    for n, g in got[False][1].items():
        assert torch.equal(got[True][1][n], g), n


@pytest.mark.parametrize("tile", [1, 7, 96, 200])  # 96 tokens in all: ragged, exact, over
def test_tiled_mlp_matches_mlp(tile):
    torch.manual_seed(0)
    mlp = MLP(CFG)
    x = torch.randn(B, T, CFG.hidden_size, requires_grad=True)
    dy = torch.randn(B, T, CFG.hidden_size)
    y0 = mlp(x)
    g0 = torch.autograd.grad(y0, [x, *mlp.parameters()], dy)
    set_mlp_tiling(mlp, tile)
    y = mlp(x)
    g = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, g0, strict=True):  # fp32 up to summation order (weight grads: over tiles)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    # bf16: weight grads accumulate over tiles in fp32, so tiling costs no extra rounding drift
    w = [
        p.detach().bfloat16().requires_grad_()
        for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    ]
    xb = x.detach().bfloat16()
    yb = tiled_mlp(xb, *w, tile)
    gb = torch.autograd.grad(yb, w, dy.bfloat16())
    for a, b in zip(gb, g0[1:], strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, rtol=0.05, atol=0.05 * b.abs().max().item())


def test_tiled_mlp_follows_autocast():
    torch.manual_seed(0)
    mlp = MLP(CFG)
    x = torch.randn(B, T, CFG.hidden_size, requires_grad=True)
    outs = []
    for tile in (None, 7):
        set_mlp_tiling(mlp, tile)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mlp(x)  # bf16 GEMMs on fp32 weights, in forward and in the tiles' backward replay
        outs.append((y, torch.autograd.grad(y.float().square().sum(), [x, *mlp.parameters()])))
    (y0, g0), (y1, g1) = outs
    assert y1.dtype == y0.dtype == torch.bfloat16
    torch.testing.assert_close(y1, y0)
    for a, b in zip(g1, g0, strict=True):  # bf16 products rounded per tile: within bf16 precision
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.02 * b.abs().max().item())


# ---- FSDP2 on 2 gloo processes ------------------------------------------------------------------
FSDP_CASES = [
    ("before", True, 5),
    ("after", True, None),
    ("after", False, 5),
]  # fully_shard order, offload, tile


def _fsdp_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for order, offload, tile in FSDP_CASES:
        m = _model()
        keys = list(m.state_dict())
        if order == "after":
            pool = apply_offload(m, offload=offload, min_bytes=0, tile_mlp=tile)
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        if order == "before":
            pool = apply_offload(m, offload=offload, min_bytes=0, tile_mlp=tile)
        steps = []
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            loss = _loss(m, _ids(10 + rank, batch=1))  # each rank its own row
            loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
            steps.append((loss.item(), grads, pool.reset_step()))
        out[(order, offload, tile)] = (steps, list(m.state_dict()) == keys)
    return out


@pytest.mark.slow
def test_fsdp2_matches_one_process():
    ref = _model()
    losses = [_loss(ref, _ids(10 + r, batch=1)) for r in range(2)]
    (sum(losses) / 2).backward()  # what FSDP2's averaged gradients must equal
    res = run_distributed(_fsdp_worker, 2)
    for case in FSDP_CASES:
        _, offload, _ = case
        for rank in range(2):
            steps, keys_same = res[rank][case]
            assert keys_same
            for step, (loss, grads, s) in enumerate(steps):
                assert loss == pytest.approx(losses[rank].item(), rel=1e-6)
                for n, p in ref.named_parameters():
                    torch.testing.assert_close(
                        grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=f"{case} {n}"
                    )
                x_bytes = T * CFG.hidden_size * 4  # one rank's fp32 row
                moved = CFG.num_hidden_layers * x_bytes if offload else 0
                assert (s.d2h_bytes, s.h2d_bytes, s.pool_bytes) == (moved, moved, moved)
                assert s.host_allocs == (
                    CFG.num_hidden_layers * _blocks_ref(x_bytes) if offload and step == 0 else 0
                )


def test_bench_runs_on_cpu():
    from bench.bench_offload import format_table, run_bench

    r = run_bench(device="cpu", tiny=True, tokens=64, layers=2, steps=1, warmup=1, tile_mlp=16)
    assert set(r["modes"]) == {"none", "ckpt", "offload", "save_on_cpu", "offload_tiled"}
    norms = [m["x_grad_norm"] for m in r["modes"].values()]
    assert max(norms) - min(norms) <= 1e-5 * max(norms)  # every mode computes the same gradient
    assert r["modes"]["offload"]["d2h_mib"] * (1 << 20) == 2 * 64 * 64 * 4
    assert r["modes"]["offload"]["host_allocs_after_warmup"] == 0
    assert (
        r["modes"]["offload"]["pinned_mib"] * (1 << 20) == 2 * 64 * 64 * 4
    )  # 16 KiB: 32 whole 512 B blocks
    assert "offload_tiled" in format_table(r)


# ---- host memory: fixed-size blocks, a layer input copied in pieces
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]
GIB = 1 << 30


def test_host_blocks_follow_the_formula_and_waste_under_2_percent():
    """Arithmetic from 32 KiB to 1 TiB: the block size formula, whole blocks, <= 1.02 x."""
    import random

    rnd = random.Random(0)
    sizes = [
        131_072 * 4096 * 2,
        3 * GIB,
        5 * 131_072 * 4096 * 2,
        999 * 50 * 2,
        999 * 50 * 4,
    ]  # recipe rows
    sizes += [m << k for k in range(15, 41) for m in (1, 3)] + [
        (1 << k) + d for k in range(15, 41) for d in (-1, 1)
    ]
    sizes += [int(2 ** rnd.uniform(15, 40)) for _ in range(2000)]
    worst = 0.0
    for n in sizes:
        b = _block_ref(n)
        assert host_block_bytes(n) == b, n
        assert host_bytes_for(n) == _blocks_ref(n) * b, n
        assert (
            b & (b - 1) == 0 and 512 <= b <= 64 << 20
        )  # a power of two: the pinned allocator adds nothing
        assert n <= host_bytes_for(n) < n + b
        worst = max(worst, host_bytes_for(n) / n)
    assert worst <= 1.02
    assert worst > 1.01  # the sizes do reach the worst case (just under 1 + 1/64)
    assert host_bytes_for(3 * GIB) == 3 * GIB  # one buffer rounded to a power of two: 4 GiB
    assert host_bytes_for(0) == 0 and host_block_bytes(1) == 512
    with pytest.raises(ValueError, match=">= 0"):
        host_block_bytes(-1)


@pytest.mark.parametrize(
    "count,shape,dtype",
    [
        (3, (1, 128, 64), torch.float32),  # 32 KiB: 64 blocks of 512 B
        (2, (1, 999, 50), torch.bfloat16),  # 99,900 B: 97 full blocks of 1 KiB and a partial one
        (4, (1, 999, 50), torch.float32),
        (1, (3, 1001, 333), torch.float32),  # 4.0 MB: 65 blocks of 64 KiB
        (2, (1, 4097, 2049), torch.bfloat16),  # 16.8 MB: 65 blocks of 256 KiB
    ],
)
def test_reserve_allocates_the_formula_in_real_buffers(count, shape, dtype):
    n = math.prod(shape) * dtype.itemsize
    pool = HostPool(min_bytes=0)
    r = pool.reserve(count, shape, dtype, "cpu")
    blocks = pool.host_buffers()
    real = sum(blk.untyped_storage().nbytes() for blk in blocks)  # what torch really holds
    assert real == count * _blocks_ref(n) * _block_ref(n) == r["pinned_bytes"]
    assert len(blocks) == count * _blocks_ref(n) == r["blocks"]
    assert {blk.numel() for blk in blocks} == {_block_ref(n)}
    s = pool.stats()
    assert (s.pinned_bytes, s.pool_bytes, s.pool_buffers, s.host_allocs) == (
        real,
        count * n,
        len(blocks),
        0,
    )
    assert real <= 1.02 * count * n
    # reserving adds room; inputs below min_bytes stay on the device, so nothing to reserve for them
    pool.reserve(1, shape, dtype, "cpu")
    assert pool.stats().pinned_bytes == (count + 1) * _blocks_ref(n) * _block_ref(n)
    pool.min_bytes = n + 1
    assert pool.reserve(5, shape, dtype, "cpu")["blocks"] == 0
    with pytest.raises(ValueError, match="count"):
        pool.reserve(-1, shape, dtype, "cpu")
    with pytest.raises(ValueError, match="cuda or cpu"):
        pool.reserve(1, shape, dtype, "meta")


ODD = replace(
    CFG, hidden_size=50, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)
ODD_T = 999  # 999 x 50 elements: no block size divides a layer input


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_reserved_pool_odd_sizes_ten_steps(device, dtype):
    """Layer inputs copied in pieces (the last one partial) come back bit for bit; after reserve()
    no step allocates and nothing grows. On CUDA also: no layer input stays on the device."""
    dev, L = torch.device(device), 3
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(DecoderLayer(ODD) for _ in range(L)).to(dev, dtype)
    ref_layers = copy.deepcopy(layers)
    x = torch.randn(1, ODD_T, ODD.hidden_size, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    cos, sin = rope_cos_sin(ODD, torch.arange(ODD_T, device=dev)[None], dtype)
    n = x.numel() * x.element_size()
    assert n % _block_ref(n) != 0  # a partial last block

    def forward(stack):
        h = x * 1.0  # a non-leaf layer-0 input, held by nothing but the layer
        for layer in stack:
            h = layer(h, cos, sin)
        return h

    def grads(stack):
        return [x.grad.clone(), *(p.grad.clone() for p in stack.parameters())]

    forward(ref_layers).backward(dy)
    ref = grads(ref_layers)
    x.grad = None

    if cuda:
        gc.collect()  # an earlier test's garbage freed now, not in the middle of this count
        apply_offload(layers, offload=False)  # plain checkpointing keeps the L inputs
        base = torch.cuda.memory_allocated()
        out = forward(layers)
        kept_plain = torch.cuda.memory_allocated() - base
        del out
        remove_offload(layers)

    pool = apply_offload(layers, min_bytes=0)
    r = pool.reserve(L, x.shape, dtype, dev)
    k = _blocks_ref(n)
    assert (r["blocks"], r["pinned_bytes"]) == (L * k, L * k * _block_ref(n))
    base, after = (torch.cuda.memory_allocated() if cuda else 0), []
    for _ in range(10):
        x.grad = None
        layers.zero_grad(set_to_none=True)
        out = forward(layers)
        if cuda:
            kept = torch.cuda.memory_allocated() - base  # the output, and no layer input
            assert kept < 2 * n, (kept, n)
            # each input kept on the device would cost n; small tensors cost far less (12,800 B
            # more than the output alone after the float32 forward on an H200)
            assert kept_plain - kept > (L - 0.5) * n, (kept_plain, kept, n)
        out.backward(dy)
        del out
        if cuda:
            torch.cuda.synchronize()
        for a, b in zip(grads(layers), ref, strict=True):
            if cuda:  # the device's kernels may sum in another order on the replay
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
            else:  # recompute replays the same ops: bit-exact, so every piece came back in place
                assert torch.equal(a, b), (a - b).abs().max()
        s = pool.reset_step()
        assert (s.d2h_bytes, s.h2d_bytes, s.d2h_copies, s.prefetched) == (L * n, L * n, L, L - 1)
        assert (s.host_allocs, s.in_use_buffers) == (
            0,
            0,
        )  # reserved: nothing allocated in any step
        assert (s.pool_buffers, s.pinned_bytes, s.pool_bytes) == (
            L * k,
            r["pinned_bytes"],
            L * n,
        )  # no growth
        assert s.pinned_bytes <= 1.02 * s.pool_bytes
        if cuda:
            assert all(blk.is_pinned() for blk in pool.host_buffers())
            x.grad = None
            layers.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            after.append(torch.cuda.memory_allocated())
    if cuda:
        assert after[0] - base < n and len(set(after)) == 1  # nothing left behind on the device


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_tiled_offload_matches_plain_checkpoint(device):
    m = _model().to(device).bfloat16()
    ids = _ids(5).to(device)
    ref = copy.deepcopy(m)
    apply_offload(ref, offload=False)
    pool = apply_offload(m, min_bytes=0, tile_mlp=32)
    x_bytes = B * T * CFG.hidden_size * 2
    for step in range(2):
        loss0, g0 = _step(ref, ids)
        loss, g = _step(m, ids)
        assert abs(loss.item() - loss0.item()) < 2e-2
        for n in g0:
            torch.testing.assert_close(
                g[n].float(), g0[n].float(), rtol=0.05, atol=0.05 * g0[n].abs().max().item()
            )
        s = pool.reset_step()
        assert s.host_allocs == (CFG.num_hidden_layers * _blocks_ref(x_bytes) if step == 0 else 0)
        assert s.d2h_bytes == CFG.num_hidden_layers * x_bytes


@pytest.mark.parametrize("hidden_act", ["gelu_pytorch_tanh", "gelu", "relu"])
def test_tiled_mlp_refuses_an_activation_other_than_silu(hidden_act):
    """Gemma's MLP is transformers' gated MLP with tanh-GELU: tiling it with SiLU would train on
    wrong gradients. transformers' own SiLU MLP (act_fn = SiLUActivation) is taken, and matches."""
    from transformers import Qwen3Config as HFConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    def hf_mlp(act):
        torch.manual_seed(0)
        cfg = HFConfig(hidden_size=CFG.hidden_size, intermediate_size=40, hidden_act=act)
        return Qwen3MLP(cfg)

    gelu = hf_mlp(hidden_act)
    with pytest.raises(TypeError, match="SiLU-gated MLPs only") as e:
        set_mlp_tiling(gelu, 7)
    assert "\n" not in str(e.value)
    assert "forward" not in gelu.__dict__  # left as it was
    silu = hf_mlp("silu")
    x = torch.randn(2, 9, CFG.hidden_size)
    y0 = silu(x)
    set_mlp_tiling(silu, 4)
    torch.testing.assert_close(silu(x), y0, rtol=1e-5, atol=1e-6)
