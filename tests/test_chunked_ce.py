"""chunked_cross_entropy against F.cross_entropy(hidden @ weight.T): loss, both gradients, and
what it allocates."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loss.chunked_ce import chunked_cross_entropy

BF16_U = 2.0**-8  # bf16 unit roundoff (8 significant bits)


def make(n, h, v, dtype=torch.float64, *, ignored=0.0, seed=0, device="cpu"):
    """hidden [n, h], weight [v, h] with logits of spread ~3, labels [n] with a share ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (3 / h**0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignored] = -100
    to = dict(dtype=dtype, device=device)
    return hidden.to(**to).requires_grad_(), weight.to(**to).requires_grad_(), labels.to(device)


def ours(hidden, weight, labels, **kw):
    loss = chunked_cross_entropy(hidden, weight, labels, **kw)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def reference(hidden, weight, labels, reduction, dtype=torch.float64):
    """F.cross_entropy on the full logits, in `dtype` (float64: exact for these inputs)."""
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, reduction=reduction)
    return (loss, *torch.autograd.grad(loss, (h, w)))


def rel(a, b):
    """Norm-wise relative error of a against b."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


# (N, chunk, V): N not a multiple of the chunk, N < one chunk, an exact multiple, prime V.
SHAPES = [(300, 64, 1001), (37, 256, 1000), (256, 64, 1000), (130, 16, 997)]


@pytest.mark.parametrize("n,chunk,v", SHAPES)
@pytest.mark.parametrize("ignored", [0.0, 0.3])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_matches_cross_entropy(n, chunk, v, ignored, reduction, dtype, tol):
    hidden, weight, labels = make(n, 24, v, dtype, ignored=ignored)
    got = ours(hidden, weight, labels, chunk_size=chunk, reduction=reduction)
    want = reference(hidden, weight, labels, reduction)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == dtype
    for name, g, w in zip(("loss", "grad hidden", "grad weight"), got, want, strict=True):
        assert rel(g, w) < tol, f"{name}: relative error {rel(g, w):.2e}"
    if ignored:
        assert (got[1][labels == -100] == 0).all()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_bfloat16_within_rounding(reduction):
    """bf16 inputs against the float64 answer for the same bf16 values.

    Each gradient element passes through two bf16 roundings (p = softmax - onehot before the
    product, and the product's output), each at most u/2 relative with u = 2^-8, so the
    norm-wise error is about u; we allow 2u. The loss only sees the rounding of the logits
    (on CPU torch has no bf16 -> fp32 product, so logits are rounded to bf16), averaged over
    rows. And ours must be no worse than PyTorch's own bf16 path, F.cross_entropy on the bf16
    logits, plus a quarter of u."""
    hidden, weight, labels = make(300, 64, 1001, torch.bfloat16, ignored=0.2)
    got = ours(hidden, weight, labels, chunk_size=64, reduction=reduction)
    exact = reference(hidden, weight, labels, reduction)
    torch_bf16 = reference(hidden, weight, labels, reduction, dtype=torch.bfloat16)
    assert got[0].dtype == torch.float32  # the loss is returned in fp32
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for name, g, t, w in zip(
        ("loss", "grad hidden", "grad weight"), got, torch_bf16, exact, strict=True
    ):
        assert rel(g, w) < 2 * BF16_U, f"{name}: {rel(g, w):.2e}"
        assert rel(g, w) <= rel(t, w) + BF16_U / 4, f"{name}: {rel(g, w):.2e} vs {rel(t, w):.2e}"


def test_bfloat16_fused_products_path(monkeypatch):
    """The CUDA path (bf16 products with fp32 output and in-place fp32 accumulation through
    out_dtype), run on CPU by giving torch.mm / torch.addmm an emulated out_dtype."""
    import loss.chunked_ce as ce

    mm = torch.mm

    def fake_mm(a, b, *, out_dtype=None, out=None):
        if out_dtype is None:
            return mm(a, b) if out is None else mm(a, b, out=out)
        return out.copy_(mm(a.float(), b.float()))  # bf16 values, exact fp32 products

    def fake_addmm(c, a, b, *, out_dtype=None, out=None):
        # CUDA's addmm would accept a bf16 accumulator too and round the sum each chunk: the
        # emulation refuses it, so a bf16 grad_w on this path fails here and not only on GPU.
        assert out_dtype == torch.float32 and out is c
        assert c.dtype == torch.float32, f"the weight-gradient accumulator is {c.dtype}, not fp32"
        return out.add_(mm(a.float(), b.float()))

    monkeypatch.setattr(torch, "mm", fake_mm)
    monkeypatch.setattr(torch, "addmm", fake_addmm)
    monkeypatch.setattr(ce, "_FUSED", {})
    assert ce.fused_ops(torch.device("cpu")) == (True, True)
    hidden, weight, labels = make(300, 64, 1001, torch.bfloat16, ignored=0.2)
    got = ours(hidden, weight, labels, chunk_size=64, reduction="mean")
    exact = reference(hidden, weight, labels, "mean")
    assert rel(got[0], exact[0]) < 1e-6  # logits never rounded to bf16: fp32 accuracy
    for g, w in zip(got[1:], exact[1:], strict=True):
        assert rel(g, w) < 2 * BF16_U


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_all_ignored_gives_zero_not_nan(dtype, reduction):
    hidden, weight, labels = make(50, 8, 33, dtype)
    labels[:] = -100
    loss, gh, gw = ours(hidden, weight, labels, chunk_size=16, reduction=reduction)
    assert loss.item() == 0.0
    assert (gh == 0).all() and (gw == 0).all()


def test_custom_ignore_index_and_int32_labels():
    hidden, weight, labels = make(100, 8, 50)
    labels[::3] = 7
    got = ours(hidden, weight, labels.int(), chunk_size=32, ignore_index=7, reduction="mean")
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, ignore_index=7)
    for g, r in zip(got, (loss, *torch.autograd.grad(loss, (h, w))), strict=True):
        assert rel(g, r) < 1e-10


def test_non_contiguous_inputs():
    hidden, weight, labels = make(90, 16, 101, ignored=0.1)
    h = torch.cat([hidden.detach(), hidden.detach()], 1)[:, :16].requires_grad_()  # row stride 32
    w = weight.detach().T.contiguous().T.requires_grad_()  # column-major
    got = ours(h, w, labels, chunk_size=32)
    for g, r in zip(got, reference(hidden, weight, labels, "sum"), strict=True):
        assert rel(g, r) < 1e-10


def test_gradcheck():
    hidden, weight, labels = make(7, 3, 5, ignored=0.0)
    labels[2] = -100
    for reduction in ("sum", "mean"):
        assert torch.autograd.gradcheck(
            lambda h, w, r=reduction: chunked_cross_entropy(
                h, w, labels, chunk_size=3, reduction=r
            ),
            (hidden, weight),
        )


def test_backward_scales_by_incoming_gradient_and_can_repeat():
    hidden, weight, labels = make(40, 8, 30, ignored=0.2)
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
    (2.5 * loss).backward(retain_graph=True)
    first = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (2.5 * loss).backward()  # retain_graph: the saved gradients were not consumed
    _, rh, rw = reference(hidden, weight, labels, "sum")
    for g, again, r in zip(first, (hidden.grad, weight.grad), (rh, rw), strict=True):
        assert rel(g, 2.5 * r) < 1e-10 and torch.equal(g, again)


class Recorder(TorchDispatchMode):
    """Records every op run and the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.overloadpacket.__name__)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ignored", [0.0, 0.25])
def test_never_allocates_n_by_v(dtype, ignored):
    n, h, v, chunk = 1024, 16, 500, 64  # N x V = 512,000; chunk x V = 32,000; V x H = 8,000
    hidden, weight, labels = make(n, h, v, dtype, ignored=ignored)
    with Recorder() as rec:
        chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk).backward()
    assert rec.largest <= max(chunk * v, v * h), rec.largest
    hidden.grad = weight.grad = None
    with Recorder() as naive:
        F.cross_entropy(hidden @ weight.T, labels).backward()
    assert naive.largest >= n * v


@pytest.mark.parametrize(
    "need_h,need_w,products",
    [(True, True, 3), (False, True, 2), (True, False, 2), (False, False, 1)],
)
def test_skips_gradients_nobody_needs(need_h, need_w, products):
    """Three matrix products per chunk with both gradients, fewer when one is not wanted."""
    hidden, weight, labels = make(100, 8, 50, ignored=0.1)
    hidden.requires_grad_(need_h)
    weight.requires_grad_(need_w)
    chunks = -(-int((labels != -100).sum()) // 32)
    with Recorder() as rec:
        loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=32)
    assert sum(op in ("mm", "addmm", "addmm_") for op in rec.ops) == products * chunks
    if need_h or need_w:
        loss.backward()
        _, rh, rw = reference(hidden, weight, labels, "sum")
        assert (hidden.grad is not None) == need_h and (weight.grad is not None) == need_w
        if need_h:
            assert rel(hidden.grad, rh) < 1e-10
        if need_w:
            assert rel(weight.grad, rw) < 1e-10
    with torch.no_grad(), Recorder() as rec:  # no_grad: loss only
        assert rel(chunked_cross_entropy(hidden, weight, labels, chunk_size=32), loss) < 1e-12
    assert sum(op in ("mm", "addmm", "addmm_") for op in rec.ops) == chunks


def test_rejects_bad_arguments():
    hidden, weight, labels = make(10, 4, 6)
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight.T, labels)
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight.float(), labels)
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight, labels[:5])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bfloat16_accuracy_and_memory():
    """On GPU: bf16 within rounding of the float64 answer, and peak memory of one chunk."""
    n, h, v, chunk = 4096, 256, 32003, 256
    hidden, weight, labels = make(n, h, v, torch.bfloat16, ignored=0.1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = ours(hidden, weight, labels, chunk_size=chunk, reduction="mean")
    peak = torch.cuda.max_memory_allocated() - base
    # chunk x V fp32 logits and log-probabilities and bf16 p; V x H fp32 accumulator, bf16
    # product (only without fused addmm) and bf16 gradient; N x H saved and returned hidden
    # gradients; 8 MB for the allocator's rounding.
    budget = chunk * v * (4 + 4 + 2) + v * h * (4 + 2 + 2) + n * h * 2 * 2 + 8 * 2**20
    assert peak <= budget, (peak, budget)
    exact = reference(hidden.cpu(), weight.cpu(), labels.cpu(), "mean")
    for name, g, w in zip(("loss", "grad hidden", "grad weight"), got, exact, strict=True):
        assert rel(g.cpu(), w) < 2 * BF16_U, f"{name}: {rel(g.cpu(), w):.2e}"
