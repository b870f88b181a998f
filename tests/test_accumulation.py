"""Weight gradients summed over many chunks (the loss) and many tiles (the MLP) in bf16: the sum
must run in fp32, and the bounds here are tight enough that a bf16 accumulator fails them.

With few chunks a bf16 running sum stays within ordinary bf16 rounding (4 chunks: 5.3e-3 < 2u);
it drifts only once there are many terms, each added rounding at the magnitude of the growing
sum. So both tests use >= 64 pieces, and each checks its bound against the two variants
emulated from the same per-piece products: the fp32 sum (which must equal ours bit for bit) and
the bf16 sum (which must fail the bound), so the bound is shown to tell them apart.
"""

import torch
import torch.nn.functional as F

from loss.chunked_ce import chunked_cross_entropy
from model.tiled_mlp import tiled_mlp

U = 2.0**-8  # bf16 machine epsilon (8 significant bits); one rounding is at most u/2 relative


def rel(a, b):
    """Norm-wise relative error of a against b."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def _sums(parts):
    """The per-piece bf16 products summed in fp32 (then cast once) and as a running bf16 sum."""
    f32 = torch.zeros(parts[0].shape, dtype=torch.float32)
    b16 = torch.zeros(parts[0].shape, dtype=torch.bfloat16)
    for p in parts:
        f32 += p.float()
        b16 += p
    return f32.bfloat16(), b16


# ---------------------------------------------------------------------------------------------
# Chunked cross-entropy: the lm_head gradient over 128 chunks
# ---------------------------------------------------------------------------------------------
def test_chunked_ce_weight_gradient_accumulates_in_fp32():
    """4096 rows in chunks of 32 (128 chunks), V 512, H 64, bf16, against float64 on the same
    bf16 values. Each element of a chunk's product sees the rounding of p (u/2), of the product's
    output (u/2) and, at the end, of the one cast of the fp32 sum (u/2): at most 1.5u norm-wise.
    A bf16 running sum adds one rounding per chunk at the size of the partial sum.
    Measured (norm-wise, in units of u = 2^-8): ours 0.93u; fp32 sum of the chunks' products
    0.93u (bit-identical to ours); bf16 sum 3.44u. Bound: 1.5u."""
    n, chunk, v, h = 4096, 32, 512, 64
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).bfloat16()
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * (3 / h**0.5)).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)

    w = weight.clone().requires_grad_()
    got = torch.autograd.grad(chunked_cross_entropy(hidden, w, labels, chunk_size=chunk), w)[0]
    w64 = weight.double().requires_grad_()
    exact = torch.autograd.grad(
        F.cross_entropy(hidden.double() @ w64.T, labels, reduction="sum"), w64
    )[0]

    parts = []
    for s in range(0, n, chunk):  # one chunk per call: its gradient is that chunk's bf16 product
        w = weight.clone().requires_grad_()
        parts.append(
            torch.autograd.grad(
                chunked_cross_entropy(
                    hidden[s : s + chunk], w, labels[s : s + chunk], chunk_size=chunk
                ),
                w,
            )[0]
        )
    fp32_sum, bf16_sum = _sums(parts)
    print(
        f"lm_head grad error / u: ours {rel(got, exact) / U:.2f}, "
        f"fp32 sum {rel(fp32_sum, exact) / U:.2f}, bf16 sum {rel(bf16_sum, exact) / U:.2f}"
    )
    assert len(parts) >= 64 and got.dtype == torch.bfloat16
    assert rel(got, exact) < 1.5 * U, f"{rel(got, exact) / U:.2f}u"
    # ours is the fp32 sum of the chunks' products: bit-equal in every run here but one (the first
    # test of a fresh 2-thread CI run, where the CPU's bf16 GEMM can split its work another way);
    # a bf16 accumulator is ~2.5u away, so a twentieth of u still tells them apart
    assert rel(got, fp32_sum) < 0.05 * U, f"{rel(got, fp32_sum) / U:.3f}u"
    assert rel(bf16_sum, exact) > 1.5 * U  # the bound is tight enough to catch a bf16 accumulator


# ---------------------------------------------------------------------------------------------
# Tiled MLP: gate, up and down gradients over 128 tiles
# ---------------------------------------------------------------------------------------------
def test_tiled_mlp_weight_gradients_accumulate_in_fp32():
    """2048 tokens in tiles of 16 (128 tiles), hidden 32, intermediate 64, bf16, against float64
    on the same bf16 values. A tile's weight gradient passes through the rounding of the gate and
    up outputs, of silu(gate) * up, of dh = dy W_down, of the product itself and of the final
    cast: about u norm-wise in practice (roundings of independent sign partly cancel); we allow 2u.
    Measured (norm-wise, in units of u, for gate / up / down): ours 1.04 / 1.05 / 1.06; fp32 sum
    of the tiles' gradients the same (bit-identical to ours); bf16 sum 3.62 / 3.57 / 3.55.
    Bound: 2u."""
    n, tile, hd, inter = 2048, 16, 32, 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, hd, generator=g).bfloat16()
    ws = [
        (torch.randn(inter, hd, generator=g) / hd**0.5).bfloat16(),
        (torch.randn(inter, hd, generator=g) / hd**0.5).bfloat16(),
        (torch.randn(hd, inter, generator=g) / inter**0.5).bfloat16(),
    ]
    dy = torch.randn(n, hd, generator=g).bfloat16()

    def grads(xs, dys):
        wr = [w.clone().requires_grad_() for w in ws]
        return torch.autograd.grad(tiled_mlp(xs, *wr, tile), wr, dys)

    got = grads(x, dy)
    w64 = [w.double().requires_grad_() for w in ws]
    y64 = F.linear(F.silu(x.double() @ w64[0].T) * (x.double() @ w64[1].T), w64[2])
    exact = torch.autograd.grad(y64, w64, dy.double())
    per_tile = [grads(x[s : s + tile], dy[s : s + tile]) for s in range(0, n, tile)]
    assert len(per_tile) >= 64
    for i, name in enumerate(("gate", "up", "down")):
        fp32_sum, bf16_sum = _sums([t[i] for t in per_tile])
        e_ours, e_b16 = rel(got[i], exact[i]), rel(bf16_sum, exact[i])
        print(f"{name} grad error / u: ours {e_ours / U:.2f}, bf16 sum {e_b16 / U:.2f}")
        assert got[i].dtype == torch.bfloat16
        assert e_ours < 2 * U, f"{name}: {e_ours / U:.2f}u"
        assert torch.equal(got[i], fp32_sum), name  # ours is exactly the fp32 sum over tiles
        assert e_b16 > 2 * U, name  # the bound is tight enough to catch a bf16 accumulator
