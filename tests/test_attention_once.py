"""Attention once per layer (model/attention.py + apply_offload(save_attention=True)).

The references: F.scaled_dot_product_attention (torch's own kernel choice) for the attention core,
the recompute path (save_attention=False: the layer's forward run twice, as before) and one
unsharded process for the gradients, and aten's attention ops, counted under a dispatch mode,
for "once". Per-layer placement (LayerPlacement: each layer's input and attention on the host,
the device, or attention recomputed) is held to the plain model's gradients, the pool's counters
to what the placement puts on the host, and the kernel count to the layers that keep attention.
"""

import copy
import gc
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from model.attention import (
    MATH_MAX_TOKENS,
    AttentionStore,
    attention,
    cudnn_gate,
    pick_backend,
    set_backend,
)
from model.attention_probe import (
    PROBE_TOKENS,
    choose_kernel,
    last_rows_reference,
    probe_kernel,
    training_layout,
)
from model.checkpoint_offload import (
    LayerPlacement,
    apply_offload,
    default_placements,
    offloaded_tensors,
)
from model.config import Qwen3Config
from model.host_pool import HostPool, host_block_bytes
from model.qwen3 import Qwen3

CFG = replace(Qwen3Config.preset("tiny"), num_hidden_layers=4)  # 4 query heads on 2 kv heads
B, T = 2, 48
X = B * T * CFG.hidden_size * 4  # fp32 layer input, bytes
OUT = B * T * CFG.num_attention_heads * CFG.head_dim * 4  # fp32 attention output
LSE = B * CFG.num_attention_heads * T * 4  # fp32 log-sum-exp


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class CountAttention(TorchDispatchMode):
    """Counts aten attention forward and backward calls (every backend's ops)."""

    def __init__(self):
        super().__init__()
        self.fwd = self.bwd = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product"):
            if name.endswith("_backward"):
                self.bwd += 1
            else:
                self.fwd += 1
        return func(*args, **(kwargs or {}))


def _model(cfg=CFG, seed=0) -> Qwen3:
    torch.manual_seed(seed)
    m = Qwen3(cfg)
    m.init_weights()
    with torch.no_grad():  # norms away from 1
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return m


def _ids(seed, batch=B, t=T, vocab=CFG.vocab_size):
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(seed))


def _loss(m, ids):
    logits = F.linear(m(ids), m.lm_head.weight)
    return F.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _max_rel(a: dict, b: dict) -> float:
    return max(
        ((a[n].double() - b[n].double()).abs().max() / b[n].double().abs().max()).item() for n in b
    )


# ---- the attention core against SDPA
def _qkv(dtype, nh, nkv, t=37, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, t, h, hd, generator=g, dtype=torch.float64) for h in (nh, nkv, nkv))
    dout = torch.randn(B, t, nh, hd, generator=g, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], dout.to(dtype)


def _sdpa(q, k, v):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _run(fn, qkv, dout):
    out = fn(*qkv)
    return [out.detach(), *torch.autograd.grad(out, qkv, dout)]


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (4, 4)])
def test_core_matches_sdpa(backend, heads):
    # fp32 and fp64: to rounding (cpu_flash is SDPA's own CPU kernel, so bit-equal)
    for dtype, rtol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        qkv, dout = _qkv(dtype, *heads)
        ref = _run(_sdpa, qkv, dout)
        got = _run(lambda q, k, v: attention(q, k, v, backend=backend), qkv, dout)
        for a, b in zip(got, ref, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            if backend == "cpu_flash":
                assert torch.equal(a, b)
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())
    # bf16: against fp64 on the same (rounded) inputs, no further off than SDPA's bf16 is, or than
    # rounding the result to bf16 is (2^-8 relative)
    qkv, dout = _qkv(torch.bfloat16, *heads)
    exact = _run(_sdpa, [x.detach().double().requires_grad_() for x in qkv], dout.double())
    sdpa_bf16 = _run(_sdpa, qkv, dout)
    got = _run(lambda q, k, v: attention(q, k, v, backend=backend), qkv, dout)
    for a, s, e in zip(got, sdpa_bf16, exact, strict=True):
        assert a.dtype == torch.bfloat16
        bound = max(2 * (s.double() - e).abs().max().item(), 2**-8 * e.abs().max().item())
        assert (a.double() - e).abs().max().item() <= bound


def test_pinned_backend_and_misuse():
    qkv, dout = _qkv(torch.float32, 4, 2)
    ref = _run(_sdpa, qkv, dout)
    try:
        set_backend("math")  # every attention() call on it, whatever the default would be
        with CountAttention() as c:
            got = _run(attention, qkv, dout)
        assert c.fwd == c.bwd == 0  # math is plain tensor ops: no aten attention op ran
        set_backend("sdpa")
        with pytest.raises(RuntimeError, match="log-sum-exp"):
            attention(*qkv, store=AttentionStore())
    finally:
        set_backend(None)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
    with (
        sdpa_kernel(SDPBackend.MATH),
        CountAttention() as c,
    ):  # unpinned: torch's switches are obeyed
        got = _run(attention, qkv, dout)
    assert c.fwd == c.bwd == 0
    with pytest.raises(ValueError, match="unknown"):
        set_backend("fast")
    store = AttentionStore()
    store.begin(replaying=True)  # a recompute that calls attention more often than the forward
    with pytest.raises(RuntimeError, match="attention call 1 but the forward made 0"):
        attention(*qkv, store=store)


# ---- choosing the backend
def _probe(usable, calls=None):
    def can_use(name, device, dtype, nh, nkv, hd):
        if calls is not None:
            calls.append((name, device.type, dtype, nh, nkv, hd))
        return name in usable

    return can_use


def test_pick_backend():
    kw = dict(num_heads=4, num_kv_heads=1, head_dim=128)
    bf16 = torch.bfloat16
    calls = []
    assert (
        pick_backend("cuda", bf16, **kw, can_use=_probe({"cudnn", "flash"}, calls)).name == "cudnn"
    )
    assert calls == [("cudnn", "cuda", bf16, 4, 1, 128)]  # asked about these shapes, grouped kv
    assert pick_backend("cuda", bf16, **kw, can_use=_probe({"flash"})).name == "flash"
    # neither fused kernel: refused at training lengths, math only for short runs
    with pytest.raises(ValueError, match="neither cuDNN nor flash attention can run torch.float32"):
        pick_backend("cuda", torch.float32, **kw, can_use=_probe(set()))
    with pytest.raises(ValueError, match="stops at 8192 tokens"):
        pick_backend(
            "cuda", torch.float32, **kw, seq_len=MATH_MAX_TOKENS + 1, can_use=_probe({"math"})
        )
    assert (
        pick_backend(
            "cuda", torch.float32, **kw, seq_len=MATH_MAX_TOKENS, can_use=_probe({"math"})
        ).name
        == "math"
    )
    # a named backend must run, and only where it exists
    assert (
        pick_backend("cuda", bf16, **kw, request="flash", can_use=_probe({"cudnn", "flash"})).name
        == "flash"
    )
    with pytest.raises(ValueError, match="'cudnn' cannot run"):
        pick_backend("cuda", bf16, **kw, request="cudnn", can_use=_probe({"flash"}))
    with pytest.raises(ValueError, match="does not run on cpu"):
        pick_backend("cpu", bf16, **kw, request="cudnn", can_use=_probe({"cudnn"}))
    with pytest.raises(ValueError, match="unknown"):
        pick_backend("cpu", bf16, **kw, request="xformers")
    # CPU, with torch's own checks
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert pick_backend("cpu", dtype, **kw).name == "cpu_flash"
    assert pick_backend("cpu", bf16, **kw, can_use=_probe(set())).name == "math"
    if not torch.cuda.is_available():  # no GPU: torch's checks say no, and say it clearly
        with pytest.raises(ValueError, match="neither cuDNN nor flash"):
            pick_backend("cuda", bf16, **kw)


def _failing(broken: dict, calls=None):
    """A probe runner: the reason for each backend in `broken`, None (it ran) for the others."""

    def probe(name, device, dtype, nh, nkv, hd, tokens=None):
        if calls is not None:
            calls.append((name, device.type, nh, nkv, hd))
        return broken.get(name)

    return probe


def test_probe_failure_falls_back_to_flash_with_the_reason(capsys):
    kw = dict(num_heads=4, num_kv_heads=1, head_dim=128, can_use=_probe({"cudnn", "flash"}))
    bf16, calls = torch.bfloat16, []
    ok = pick_backend("cuda", bf16, **kw, probe=_failing({}, calls))
    assert (ok.name, ok.why, calls) == ("cudnn", "", [("cudnn", "cuda", 4, 1, 128)])
    boom = "RuntimeError: cuDNN Frontend error: No valid execution plans built."
    c = pick_backend("cuda", bf16, **kw, probe=_failing({"cudnn": boom}))
    assert c.name == "flash" and c.passed_over == (f"cudnn: {boom}",)
    refused = pick_backend("cuda", bf16, **{**kw, "can_use": _probe({"flash"})}, probe=_failing({}))
    assert refused.why == "cudnn: torch's checks refuse these shapes"
    # nothing runs: one line naming each kernel's reason
    broken = {"cudnn": boom, "flash": "dq of the last 8 rows is off by 0.7 of its largest value"}
    with pytest.raises(ValueError) as e:
        pick_backend("cuda", bf16, **kw, seq_len=2**20, probe=_failing(broken))
    msg = str(e.value)
    assert "\n" not in msg and f"cudnn: {boom}; flash: {broken['flash']}" in msg
    assert msg.startswith("attention: neither cuDNN nor flash attention can run")
    # a named backend that fails its probe is refused, not swapped
    with pytest.raises(ValueError, match="'cudnn' failed its probe .*No valid execution plans"):
        pick_backend("cuda", bf16, **kw, request="cudnn", probe=_failing({"cudnn": boom}))
    # the run's log line names the kernel and why the one before it was passed over
    import train
    from memory.plan import plan
    from model.config import ConfigError
    from run.build import choose_attention, log_attention

    tiny = Qwen3Config.preset("tiny")
    planned = plan(tiny, 512, gpus=1, sp=1, device="cpu")
    log_attention(train.TrainConfig(seq_len=512), tiny, 1, torch.float32, c, planned)
    kernel, layout = capsys.readouterr().out.splitlines()[:2]
    assert kernel == f"attention: FlashAttention-2 (flash; cudnn: {boom})", kernel
    assert layout.startswith("layout: inputs 2 host; attention 2 recomputed (given)"), layout
    # and a refusal becomes its one-line ConfigError

    if not torch.cuda.is_available():
        cfg = train.TrainConfig(seq_len=2**20)
        with pytest.raises(ConfigError) as e:
            choose_attention(cfg, Qwen3Config.preset("qwen3-8b"), 8, torch.device("cuda"), bf16)
        assert "\n" not in str(e.value) and "cudnn: torch's checks refuse" in str(e.value)


def test_cudnn_gate_is_torchs_rule():
    """torch prefers cuDNN attention above cuDNN 9.15.0 on sm90/sm100 (sm90, sm100, sm103 before
    CUDA 13): sdp_utils.cpp's check_prefer_cudnn_attention."""
    assert cudnn_gate(91501, (9, 0), "12.8") is None  # H100/H200, cuDNN 9.15.1
    assert cudnn_gate(91600, (10, 0), "13.0") is None
    assert cudnn_gate(91600, (10, 3), "12.9") is None
    assert "cuDNN 9.15.0: torch prefers cuDNN attention only above 9.15.0" in cudnn_gate(
        91500, (9, 0), "12.8"
    )
    assert "cuDNN 9.10.2" in cudnn_gate(91002, (9, 0), "12.8")
    assert "cuDNN none" in cudnn_gate(None, (9, 0), "12.8")
    assert "sm80" in cudnn_gate(91600, (8, 0), "13.0")  # A100: flash first
    assert cudnn_gate(91600, (10, 1), "13.0") is None and "sm101" in cudnn_gate(
        91600, (10, 1), "12.9"
    )


def test_probe_runs_the_kernel_in_the_training_layout():
    """The real probe on CPU: torch's CPU kernels pass; a kernel that is wrong past the first tile
    (here: it sees only the first 4096 keys) or that raises is caught, with the reason."""
    heads = (4, 2, 16)
    assert probe_kernel("cpu_flash", "cpu", torch.float32, *heads) is None
    assert probe_kernel("math", "cpu", torch.float64, *heads, tokens=600) is None
    seen = []

    def misread(q, k, v, backend):  # the ragged last tile reads the first tile's keys again
        seen.append((backend, q.shape, q.stride(), k.shape, k.stride()))
        k, v = (torch.cat([t[:, :4096], t[:, : t.shape[1] - 4096]], 1) for t in (k, v))
        return attention(q, k, v, backend=backend)

    why = probe_kernel("cpu_flash", "cpu", torch.float32, *heads, attend=misread)
    assert re.fullmatch(r"(out|dq|dk|dv) of the last 8 rows is off by [0-9.e-]+ of .*", why), why
    T = PROBE_TOKENS  # [1, T, heads, hd] contiguous, as the exchange leaves them
    assert seen == [
        ("cpu_flash", (1, T, 4, 16), (T * 64, 64, 16, 1), (1, T, 2, 16), (T * 32, 32, 16, 1))
    ]

    def raising(q, k, v, backend):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")

    why = probe_kernel("cpu_flash", "cpu", torch.float32, *heads, tokens=300, attend=raising)
    assert why == "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_last_rows_reference_matches_fp64_attention():
    q, k, v, dout = training_layout(300, 6, 2, 8, torch.float64, "cpu")
    ref = last_rows_reference(q, k, v, dout, 8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    got = _run(_sdpa, [q, k, v], dout)
    for name, t in zip(("out", "dq", "dk", "dv"), got, strict=True):
        torch.testing.assert_close(ref[name].double(), t[0, -8:], rtol=1e-5, atol=1e-6)


# ---- attention once inside the checkpointed, offloaded layer
def _step(m, ids, micro=1):
    m.zero_grad(set_to_none=True)
    counts = []
    for i in range(micro):
        with CountAttention() as c:
            loss = _loss(m, ids if micro == 1 else ids[i : i + 1])
            loss.backward()
        counts.append((c.fwd, c.bwd))
    return loss.detach(), _grads(m), counts


@pytest.mark.parametrize("offload,tile", [(True, None), (False, None), (True, 16)])
def test_attention_runs_once_with_the_same_gradients(offload, tile):
    L = CFG.num_hidden_layers
    ref, ids = _model(), _ids(1)
    loss0, g0, _ = _step(ref, ids)  # no checkpointing at all
    res = {}
    for save in (False, True):
        m = copy.deepcopy(ref)
        pool = apply_offload(m, offload=offload, min_bytes=0, tile_mlp=tile, save_attention=save)
        for _ in range(2):
            loss, g, counts = _step(m, ids)
            s = pool.reset_step()
        assert counts == [(L if save else 2 * L, L)]  # forward kernel once per layer, or twice
        res[save] = (loss, g, s)
    (l_re, g_re, s_re), (l_once, g_once, s_once) = res[False], res[True]
    assert l_once == l_re
    assert _max_rel(g_once, g_re) <= 1e-6  # the same gradients as recomputing attention
    assert _max_rel(g_once, g0) <= 1e-5
    if offload:  # everything kept went through the pool and came back once; the last layer stays
        kept = (L - 1) * (X + OUT + LSE)
        assert (s_once.d2h_bytes, s_once.h2d_bytes, s_once.pool_bytes) == (kept, kept, kept)
        assert s_once.d2h_copies == s_once.h2d_copies == 3 * (L - 1)
        assert (
            s_once.prefetched == s_once.h2d_copies
        )  # every copy back started before it was needed
        assert s_once.host_allocs == 0 and s_once.in_use_buffers == 0
        assert s_re.d2h_bytes == L * X  # the recompute path: inputs only, as before
    else:
        assert s_once.d2h_bytes == 0


def test_a_layers_three_copies_back_start_together_one_layer_ahead(monkeypatch):
    """Backward asks the pool for layer i's input, out and lse in turn (its recompute); by the
    first of them the three are on their way, and layer i-1's three start copying back at that
    moment, all together: the pool's copies back counted at each of backward's requests."""
    L = CFG.num_hidden_layers
    m, ids = _model(), _ids(6)
    pool = apply_offload(m, min_bytes=0, save_attention=True)
    seen, unpack = [], pool.unpack

    def counting(packed):  # the pool's unpack hook, as apply_offload installed it
        out = unpack(packed)
        if not isinstance(packed, torch.Tensor):  # a tensor the pool moved
            seen.append((out.numel() * out.element_size(), pool.stats().h2d_copies))
        return out

    monkeypatch.setattr(pool, "unpack", counting)
    _loss(m, ids).backward()
    s = pool.reset_step()
    # layers L-2 .. 0, each asked for in the order its recompute needs them: input, out, lse; the
    # last layer's recompute has already started layer L-2's three
    want = []
    for i in range(L - 2, -1, -1):
        started = 3 * (L - 1 - i) + (3 if i > 0 else 0)  # layer i's and (i > 0) layer i-1's
        want += [(X, started), (OUT, started), (LSE, started)]
    assert seen == want
    assert s.prefetched == s.h2d_copies == 3 * (L - 1)


def test_bf16_and_grad_accumulation():
    L = CFG.num_hidden_layers
    ref = _model().bfloat16()
    ids = _ids(2)
    res = {}
    for save in (False, True):
        m = copy.deepcopy(ref)
        pool = apply_offload(m, min_bytes=0, tile_mlp=32, save_attention=save)
        loss, g, counts = _step(m, ids, micro=2)  # two micro-steps accumulate into .grad
        assert counts == [(L if save else 2 * L, L)] * 2
        assert pool.reset_step().in_use_buffers == 0
        res[save] = (loss, g)
    assert res[True][0] == res[False][0]
    for n, g in res[False][1].items():  # bf16 recompute replays the same ops: bit-equal
        assert torch.equal(res[True][1][n], g), n


def test_retain_graph_replays_twice():
    m, ids = _model(), _ids(3)
    ref = copy.deepcopy(m)
    _, g0, _ = _step(ref, ids)
    apply_offload(m, min_bytes=0, save_attention=True)
    m.zero_grad(set_to_none=True)
    with CountAttention() as c:
        loss = _loss(m, ids)
        loss.backward(retain_graph=True)  # the kept attention survives a retained graph
        loss.backward()
    assert (c.fwd, c.bwd) == (CFG.num_hidden_layers, 2 * CFG.num_hidden_layers)
    assert _max_rel(_grads(m), {n: 2 * g for n, g in g0.items()}) <= 1e-5


def test_ten_steps_hold_no_more():
    m = _model()
    pool = apply_offload(m, min_bytes=0, tile_mlp=16, save_attention=True)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    seen, live = [], []
    # x, out and lse of every layer but the last, each in whole blocks of the pool's layout
    blocks = (CFG.num_hidden_layers - 1) * sum(-(-n // host_block_bytes(n)) for n in (X, OUT, LSE))
    for step in range(10):
        opt.zero_grad(set_to_none=False)
        if (
            step % 3 == 2
        ):  # a graph dropped without backward (an exception, say) gives its buffers back
            _loss(m, _ids(step))
        _loss(m, _ids(step)).backward()
        opt.step()
        s = pool.reset_step()
        seen.append((s.pool_bytes, s.pool_buffers, s.in_use_buffers, pool.copies_in_flight()))
        assert s.host_allocs == (
            blocks if step == 0 else 0
        )  # host blocks: all in step 1, none after
        if step in (1, 9):
            gc.collect()
            live.append(
                sum(
                    1
                    for o in gc.get_objects()
                    if type(o) in (torch.Tensor, torch.nn.Parameter, AttentionStore)
                )
            )
    kept = (CFG.num_hidden_layers - 1) * (X + OUT + LSE)
    assert set(seen) == {(kept, blocks, 0, 0)}, seen
    assert live[0] == live[1]  # no tensor or store accumulates from step 2 to step 10


# ---- per-layer placement: "input/attention" for each of the 4 layers, forward order
def _places(*names) -> list[LayerPlacement]:
    return [LayerPlacement(*name.split("/")) for name in names]


PLACEMENTS = {
    "mixed": _places("host/host", "device/device", "host/recompute", "device/host"),
    "all-device": _places(*["device/device"] * 4),
    "all-recompute": _places(*["host/recompute"] * 4),
    "device-recompute": _places(*["device/recompute"] * 4),
    "inputs-on-device": _places("device/host", "device/recompute", "device/host", "device/device"),
    "host-last": _places("device/recompute", "host/host", "device/device", "host/host"),
}


@pytest.mark.parametrize("name", PLACEMENTS)
def test_any_placement_gives_the_plain_gradients_and_moves_what_it_says(name):
    places, L = PLACEMENTS[name], CFG.num_hidden_layers
    ref, ids = _model(), _ids(7)
    loss0, g0, _ = _step(ref, ids)  # no checkpointing at all
    m = copy.deepcopy(ref)
    pool = apply_offload(m, min_bytes=0, placements=places)
    for _ in range(2):  # step 2 reuses step 1's blocks
        loss, g, counts = _step(m, ids)
        s = pool.reset_step()
    recomputed = sum(p.attention == "recompute" for p in places)
    assert counts == [(L + recomputed, L)]  # attention's forward once where kept, else twice
    assert abs(loss - loss0) <= 1e-6 * abs(loss0)
    assert _max_rel(g, g0) <= 1e-6
    inputs = sum(p.input == "host" for p in places)
    kept = sum(p.attention == "host" for p in places)
    moved, copies = inputs * X + kept * (OUT + LSE), inputs + 2 * kept
    assert (s.d2h_bytes, s.h2d_bytes, s.pool_bytes) == (moved, moved, moved)
    assert s.d2h_copies == s.h2d_copies == copies
    # every copy back starts before backward asks for it, but the very first one when the last
    # layer has tensors on the host (backward starts there): device-only layers between two that
    # have start the lower one's copies back as they recompute
    assert s.prefetched == copies - places[-1].on_host
    assert s.host_allocs == 0 and s.in_use_buffers == 0


@pytest.mark.parametrize("name", PLACEMENTS)
def test_offloaded_tensors_are_what_a_placement_moves(name):
    places = PLACEMENTS[name]
    m, ids = _model(), _ids(8, batch=1)  # offloaded_tensors' shapes are one row's
    pool = HostPool(min_bytes=0)
    kinds = offloaded_tensors(CFG, T, dtype=torch.float32, placements=places)
    for kind in kinds:
        pool.reserve(kind.count, kind.shape, kind.dtype, "cpu")
    apply_offload(m, pool=pool, placements=places)
    _loss(m, ids).backward()
    s = pool.reset_step()
    reserved = sum(kind.count * kind.nbytes for kind in kinds)
    assert s.host_allocs == 0  # every block the step took was reserved
    assert s.d2h_bytes == s.pool_bytes == reserved  # and every reserved one was taken
    assert len(kinds) == (1 if all(p.attention == "recompute" for p in places) else 3)


def test_default_placements_are_the_keyword_arguments():
    L = CFG.num_hidden_layers
    host, device = LayerPlacement("host", "host"), LayerPlacement("device", "device")
    assert default_placements(L, save_attention=True) == [host] * (L - 1) + [device]
    assert default_placements(L) == _places(*["host/recompute"] * L)
    assert default_placements(L, save_attention=True, offload=False) == [device] * L
    for save in (False, True):
        old = offloaded_tensors(CFG, T, dtype=torch.float32, save_attention=save)
        placed = default_placements(L, save_attention=save)
        assert offloaded_tensors(CFG, T, dtype=torch.float32, placements=placed) == old
    with pytest.raises(ValueError, match="LayerPlacement.attention must be one of"):
        LayerPlacement("host", "cpu")
    with pytest.raises(ValueError, match="3 placements for 4 layers"):
        apply_offload(_model(), placements=[host] * 3)
    with pytest.raises(ValueError, match="not both"):
        apply_offload(_model(), save_attention=True, placements=[host] * L)
    with pytest.raises(ValueError, match="puts tensors on the host, but pool is None"):
        apply_offload(_model(), offload=False, placements=[host] * L)


# ---- Ulysses sp=2 with kv repeat, FSDP2, tiled MLP, grad accumulation: 2 gloo processes
SP_CFG = replace(CFG, num_key_value_heads=1, num_hidden_layers=3)  # 1 kv head, repeated to 2 ranks
SP_T = 32


def _sp_worker(rank, world):
    import torch.distributed as dist

    from model.parallel import apply_fsdp, build_mesh
    from model.ulysses import UlyssesAttention

    mesh = build_mesh(world, sp=world, device_type="cpu")
    rows = [
        _ids(20 + i, batch=1, t=SP_T + 1, vocab=SP_CFG.vocab_size) for i in range(2)
    ]  # 2 micro-steps
    sl = slice(rank * SP_T // world, (rank + 1) * SP_T // world)
    out = {}
    for save in (False, True):
        m = _model(SP_CFG)
        apply_fsdp(m, mesh)
        m.set_attention(UlyssesAttention(mesh["sp"].get_group()))
        pool = apply_offload(m, min_bytes=0, tile_mlp=5, save_attention=save)
        m.zero_grad(set_to_none=True)
        counts = []
        for row in rows:  # labels shifted before sharding; loss = local sum / global count
            ids, labels = row[:, :-1][:, sl], row[:, 1:][:, sl]
            pos = torch.arange(SP_T)[sl][None]
            with CountAttention() as c:
                hidden = m(ids, pos)
                loss = F.cross_entropy(
                    F.linear(hidden, m.lm_head.weight).flatten(0, 1),
                    labels.flatten(),
                    reduction="sum",
                ) / (2 * SP_T)
                loss.backward()
            counts.append((c.fwd, c.bwd))
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        out[save] = (grads, counts, pool.reset_step().in_use_buffers)
    dist.barrier()
    return out


@pytest.mark.slow
def test_ulysses_fsdp_once_equals_recompute_and_one_process():
    ref = _model(SP_CFG)
    rows = [_ids(20 + i, batch=1, t=SP_T + 1, vocab=SP_CFG.vocab_size) for i in range(2)]
    for row in rows:  # one process, the whole row, no checkpointing
        logits = F.linear(ref(row[:, :-1]), ref.lm_head.weight)
        (
            F.cross_entropy(logits.flatten(0, 1), row[:, 1:].flatten(), reduction="sum")
            / (2 * SP_T)
        ).backward()
    g_ref = _grads(ref)
    L = SP_CFG.num_hidden_layers
    for rank_out in run_distributed(_sp_worker, 2):
        (g_re, c_re, _), (g_once, c_once, in_use) = rank_out[False], rank_out[True]
        assert c_re == [(2 * L, L)] * 2 and c_once == [(L, L)] * 2  # per micro-step, on each rank
        assert in_use == 0
        assert _max_rel(g_once, g_re) <= 1e-6
        assert _max_rel(g_once, g_ref) <= 1e-5


# ---- CUDA only: the kernels training pins
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_cuda_backend_matches_fp64(backend):
    kw = dict(num_heads=4, num_kv_heads=1, head_dim=128)  # one Ulysses rank of Qwen3-8B at sp=8
    try:
        pick_backend("cuda", torch.bfloat16, **kw, request=backend)
    except ValueError as e:
        pytest.skip(str(e))
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = [
        torch.randn(
            1, 2048, h, 128, generator=g, device="cuda", dtype=torch.bfloat16
        ).requires_grad_()
        for h in (4, 1, 1)
    ]
    dout = torch.randn(1, 2048, 4, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    exact = _run(
        lambda q, k, v: attention(q, k, v, backend="math"),
        [x.detach().double().requires_grad_() for x in qkv],
        dout.double(),
    )
    sdpa_bf16 = _run(_sdpa, qkv, dout)
    with CountAttention() as c:
        got = _run(lambda q, k, v: attention(q, k, v, backend=backend), qkv, dout)
    assert (c.fwd, c.bwd) == (1, 1)
    for a, s, e in zip(got, sdpa_bf16, exact, strict=True):
        bound = max(2 * (s.double() - e).abs().max().item(), 2**-8 * e.abs().max().item())
        assert (a.double() - e).abs().max().item() <= bound


@pytest.mark.cuda
@needs_cuda
def test_cuda_attention_once_with_offload():
    L = CFG.num_hidden_layers
    ref = _model().cuda().bfloat16()
    ids = _ids(5).cuda()
    res = {}
    for save in (False, True):
        m = copy.deepcopy(ref)
        pool = apply_offload(m, min_bytes=0, tile_mlp=32, save_attention=save)
        for _ in range(2):
            loss, g, counts = _step(m, ids)
            s = pool.reset_step()
            torch.cuda.synchronize()
        assert counts == [(L if save else 2 * L, L)]
        assert s.host_allocs == 0 and s.in_use_buffers == 0
        if save:
            assert s.prefetched == s.h2d_copies == s.d2h_copies == 3 * (L - 1)
        res[save] = (loss, g)
    for n, g in res[False][1].items():  # cuDNN's backward may sum in another order: bf16 tolerance
        torch.testing.assert_close(
            res[True][1][n].float(), g.float(), rtol=0.02, atol=0.02 * g.abs().max().item()
        )


def _fails_long(broken_on_rank=None, rank=None):
    """A kernel that runs at the probe's old 4,104 tokens and fails above them (an engine config
    or a workspace cuDNN finds only at the training length), on every rank or on one."""
    calls = []

    def probe(name, device, dtype, nh, nkv, hd, tokens=None):
        calls.append((name, nh, nkv, hd, tokens))
        too_long = tokens is not None and tokens > PROBE_TOKENS
        if name in ("cudnn", "cpu_flash") and too_long and broken_on_rank in (None, rank):
            return "RuntimeError: cuDNN Frontend error: No valid execution plans built."
        return None

    probe.calls = calls
    return probe


def test_the_kernel_is_probed_at_the_runs_own_per_rank_shape():
    """The recipe's rank at sp 8: 32/8 query heads, 8/8 kv heads, every token of the row (padded
    to a multiple of 8); a kernel failing only above the old probe length is passed over."""
    config = Qwen3Config.preset("qwen3-8b")
    probe = _fails_long()
    can_use = _probe({"cudnn", "flash"})
    c = choose_kernel("cuda", torch.bfloat16, config, 1_048_573, 8, probe=probe, can_use=can_use)
    assert probe.calls[0] == ("cudnn", 4, 1, 128, 1_048_576)
    assert c.name == "flash" and c.why.startswith("cudnn: RuntimeError: cuDNN Frontend error")
    short = choose_kernel(
        "cuda", torch.bfloat16, config, 4096, 8, probe=_fails_long(), can_use=can_use
    )
    assert short.name == "cudnn"  # what the old fixed-length probe would have said at 1M too


def _choose_with_a_planted_kernel(rank, world, broken_on_rank, sticky):
    """run/build.py's choose_attention on CPU with a planted probe (the CUDA path's, on CPU):
    cpu_flash fails above 4,104 tokens on one rank; sticky: that failure breaks the device."""
    import run.build as build
    import train

    planted = _fails_long(broken_on_rank, rank)
    build.kernel_probe = lambda device: planted
    if sticky:
        build.device_usable = lambda device: rank != broken_on_rank

        def stop_every_rank(message):  # the real one exits the process at once
            raise SystemExit(message)

        build.stop_every_rank = stop_every_rank
    cfg = train.TrainConfig(seq_len=8192)
    try:
        _, choice = build.choose_attention(cfg, CFG, 2, torch.device("cpu"), torch.float32)
    except SystemExit as e:
        return {"stopped": str(e)}
    return {"name": choice.name, "why": choice.why, "tokens": planted.calls[0][-1]}


@pytest.mark.slow
def test_every_rank_takes_the_same_kernel_when_one_ranks_probe_fails():
    """Rank 1's kernel fails at the run's length, rank 0's does not: both fall back alike, the
    reason naming rank 1. A failure that leaves the device unusable stops every rank with one
    line naming the kernel."""
    got = run_distributed(_choose_with_a_planted_kernel, 2, 1, False)
    assert got[0] == got[1], got
    assert got[0]["name"] == "math" and got[0]["tokens"] == 8192
    assert got[0]["why"].endswith("No valid execution plans built. (on rank 1)"), got[0]
    stopped = run_distributed(_choose_with_a_planted_kernel, 2, 1, True)
    assert stopped[0] == stopped[1], stopped
    line = stopped[0]["stopped"]
    assert "\n" not in line
    assert line.startswith("attention: probing the cpu_flash kernel left CUDA unusable on rank 1")
