"""model/delta_rule.py: the chunked gated delta rule against its per-token recurrence (fp64, every
gradient), both against transformers' Qwen3.5 functions, documents against running each alone,
and what the chunked form keeps for backward."""

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

import model.delta_rule as dr
from model.delta_rule import gated_delta_rule, recurrent_gated_delta_rule

BF16_U = 2.0**-8  # bf16 unit roundoff


def make(b, t, hk, hv, dk, dv, dtype=torch.float64, *, seed=0, initial=False):
    """Seeded q, k [B, T, Hk, dk], v [B, T, Hv, dv], g [B, T, Hv] in [-0.7, 0] (some steps
    near 1, some forgetting fast), beta [B, T, Hv] in (0, 1), and an initial state or None,
    all requiring grad."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(b, t, hk, dk), rand(b, t, hk, dk), rand(b, t, hv, dv)
    g = -0.7 * torch.rand(b, t, hv, generator=gen, dtype=torch.float64) ** 2
    beta = torch.sigmoid(rand(b, t, hv))
    s0 = rand(b, hv, dk, dv) if initial else None
    xs = [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]
    return (*xs, None if s0 is None else s0.to(dtype).requires_grad_())


def weights(*like, seed=1):
    """Fixed random cotangents, one per tensor: the loss sum(w * out) reaches every element."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) for x in like]


def run(fn, inputs, **kw):
    """fn's output and final state, and the gradients of sum(w_o * out) + sum(w_s * state)
    with respect to every input that requires grad."""
    q, k, v, g, beta, s0 = inputs
    out, state = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, **kw)
    w_o, w_s = weights(out, state)
    loss = (out * w_o).sum() + (state * w_s).sum()
    leaves = [x for x in inputs if x is not None]
    return [out, state, *torch.autograd.grad(loss, leaves)]


def rel(a, b):
    """Norm-wise relative error of a against b."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


NAMES = ("out", "state", "dq", "dk", "dv", "dg", "dbeta", "dinitial")

BLOCK = 16  # chunks a block in these tests: several blocks at their lengths

# (T, chunk, Hk, Hv, doc_lens, initial): T not a multiple of the chunk; several blocks
# (BLOCK * chunk = 64 tokens at chunk 4); grouped heads; documents incl. a one-token one
# and one starting exactly at a block boundary (64); a chunk longer than the row.
CASES = [
    (150, 16, 2, 2, None, False),
    (150, 4, 2, 2, None, True),
    (97, 8, 1, 4, None, True),
    (150, 4, 2, 4, (40, 1, 60, 49), True),
    (150, 4, 2, 2, (64, 30, 1, 55), False),
    (130, 8, 2, 4, (1, 63, 1, 65), True),
    (37, 64, 2, 2, (20, 17), True),
]


@pytest.mark.parametrize("state_pass", ["scan", "loop"])
@pytest.mark.parametrize("t,chunk,hk,hv,docs,initial", CASES)
def test_chunked_matches_recurrence_fp64(t, chunk, hk, hv, docs, initial, state_pass):
    """Both passes of the state through the chunks: the scan of their maps (odd and even chunk
    counts, a piece of one chunk) and the textbook loop."""
    inputs = make(2, t, hk, hv, 8, 6, initial=initial)
    kw = {"doc_lens": docs, "chunk": chunk, "block_chunks": BLOCK, "state_pass": state_pass}
    got = run(gated_delta_rule, inputs, **kw)
    want = run(recurrent_gated_delta_rule, inputs, doc_lens=docs)
    errors = {n: rel(a, b) for n, a, b in zip(NAMES, got, want, strict=False)}
    print(f"T={t} chunk={chunk} Hk={hk} Hv={hv} docs={docs} {state_pass}: worst "
          f"{max(errors.values()):.1e}")  # fmt: skip
    for name, err in errors.items():
        assert err < 1e-10, f"{name}: relative error {err:.2e}"


def hf_run(fn, inputs, **kw):
    """transformers' function on our inputs (L2 normalisation in its kernel), as run()."""
    q, k, v, g, beta, s0 = inputs
    out, state = fn(
        q,
        k,
        v,
        g,
        beta,
        initial_state=s0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **kw,
    )
    w_o, w_s = weights(out, state)
    loss = (out * w_o).sum() + (state.to(out.dtype) * w_s.to(out.dtype)).sum()
    leaves = [x for x in inputs if x is not None]
    return [out, state, *torch.autograd.grad(loss, leaves)]


# transformers computes in fp32 whatever the input dtype, so fp64 inputs meet it at fp32 accuracy.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hk,hv", [(2, 2), (1, 2)])
def test_recurrence_matches_transformers(dtype, hk, hv):
    inputs = make(2, 70, hk, hv, 16, 8, dtype, initial=True)
    got = run(recurrent_gated_delta_rule, inputs)
    want = hf_run(hf.torch_recurrent_gated_delta_rule, inputs)
    assert got[0].dtype == dtype
    print(f"worst {max(rel(a, b) for a, b in zip(got, want, strict=True)):.1e}")
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel(a, b) < 2e-5, f"{name}: relative error {rel(a, b):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t,chunk", [(200, 16), (64, 64), (130, 32)])
def test_chunked_matches_transformers(dtype, t, chunk):
    inputs = make(1, t, 2, 4, 16, 8, dtype, initial=True)
    got = run(gated_delta_rule, inputs, chunk=chunk)
    want = hf_run(hf.torch_chunk_gated_delta_rule, inputs, chunk_size=chunk)
    print(f"worst {max(rel(a, b) for a, b in zip(got, want, strict=True)):.1e}")
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel(a, b) < 2e-5, f"{name}: relative error {rel(a, b):.2e}"


@pytest.mark.parametrize("chunk", [4, 16])
def test_documents_equal_each_document_alone(chunk):
    """Packed documents: each one's output is what it gives run alone (the first from the initial
    state, the rest from zero), and the final state is the last document's."""
    docs = (40, 1, 23, 22, 7, 57)  # at chunk 4 (blocks of 64 tokens) one starts a block
    q, k, v, g, beta, s0 = make(2, sum(docs), 2, 4, 8, 6, initial=True)
    out, state = gated_delta_rule(
        q, k, v, g, beta, doc_lens=docs, initial_state=s0, chunk=chunk, block_chunks=BLOCK,
        output_final_state=True,
    )  # fmt: skip
    at = 0
    for i, n in enumerate(docs):
        sl = slice(at, at + n)
        alone, last = gated_delta_rule(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], chunk=chunk,
            initial_state=s0 if i == 0 else None, output_final_state=True,
        )  # fmt: skip
        assert rel(out[:, sl], alone) < 1e-12, f"document {i}: {rel(out[:, sl], alone):.2e}"
        at += n
    assert rel(state, last) < 1e-12


def test_bf16_inputs_within_rounding():
    """bf16 in, bf16 out (and bf16 gradients), computed in fp32: against the fp64 recurrence on
    the same bf16 values, each result is off by its final rounding (u / 2 relative per element)
    and fp32's error: we allow u."""
    inputs = make(1, 200, 2, 4, 32, 32, torch.bfloat16, initial=True)
    got = run(gated_delta_rule, inputs, chunk=16, doc_lens=(120, 80))
    exact = [None if x is None else x.detach().double().requires_grad_() for x in inputs]
    want = run(recurrent_gated_delta_rule, exact, doc_lens=(120, 80))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert all(d.dtype == torch.bfloat16 for d in got[2:])
    print({name: f"{rel(a, b):.1e}" for name, a, b in zip(NAMES, got, want, strict=True)})
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel(a, b) < BF16_U, f"{name}: relative error {rel(a, b):.2e}"


def saved_bytes(fn, inputs, **kw) -> int:
    """Bytes of every tensor autograd keeps for backward of fn(*inputs), and the backward run."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs, **kw)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out.sum(), inputs)
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)
    return total


@pytest.mark.parametrize("docs", [False, True])
def test_saved_for_backward_is_inputs_and_block_states(docs):
    """What the chunked form keeps for backward is its inputs and one [B, Hv, dk, dv] state per
    block, at any length; autograd through transformers' chunk form keeps several times more,
    growing with every chunk (the check would see intermediates if they were kept)."""
    b, hk, hv, dk, dv, chunk = 1, 2, 4, 16, 16, 16
    block = BLOCK * chunk
    state_bytes = b * hv * dk * dv * 4
    found = {}
    for t in (2 * block, 8 * block + 40):
        inputs = [x.float().detach().requires_grad_() for x in make(b, t, hk, hv, dk, dv)[:5]]
        doc_lens = (t // 3, 1, t - t // 3 - 1) if docs else None
        kw = {"chunk": chunk, "block_chunks": BLOCK, "doc_lens": doc_lens}
        ours = saved_bytes(gated_delta_rule, inputs, **kw)
        inputs_bytes = sum(x.numel() * x.element_size() for x in inputs)
        n_blocks = -(-t // block)
        assert ours <= inputs_bytes + n_blocks * state_bytes, (t, ours, inputs_bytes)
        theirs = saved_bytes(
            hf.torch_chunk_gated_delta_rule, inputs, chunk_size=chunk, use_qk_l2norm_in_kernel=True
        )
        assert theirs > 3 * ours, (t, theirs, ours)
        found[t] = (ours, inputs_bytes, n_blocks)
        print(
            f"T={t}: ours {ours:,} B saved (inputs {inputs_bytes:,} B), transformers {theirs:,} B"
        )
    (s1, i1, n1), (s2, i2, n2) = found.values()
    assert s2 - s1 <= (i2 - i1) + (n2 - n1) * state_bytes


def test_many_blocks_backward_matches_recurrence(monkeypatch):
    """One chunk per block: every block boundary is a recompute boundary."""
    monkeypatch.setattr(dr, "BLOCK_CHUNKS", 1)
    inputs = make(1, 90, 1, 2, 8, 8, initial=True)
    got = run(gated_delta_rule, inputs, chunk=8, doc_lens=(8, 30, 1, 51))
    want = run(recurrent_gated_delta_rule, inputs, doc_lens=(8, 30, 1, 51))
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel(a, b) < 1e-10, f"{name}: relative error {rel(a, b):.2e}"


def test_without_final_state_or_initial_grad():
    """The plain call returns the output alone; an initial state that needs no gradient, and
    inputs of which only some need one, still backpropagate."""
    q, k, v, g, beta, s0 = make(1, 50, 2, 2, 8, 8, initial=True)
    s0 = s0.detach()
    out = gated_delta_rule(q.detach(), k, v.detach(), g, beta.detach(), initial_state=s0, chunk=8)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 50, 2, 8)
    dk, dg = torch.autograd.grad(out.sum(), (k, g))
    ref = recurrent_gated_delta_rule(q.detach(), k, v.detach(), g, beta.detach(), initial_state=s0)
    want = torch.autograd.grad(ref.sum(), (k, g))
    assert rel(out, ref) < 1e-10 and rel(dk, want[0]) < 1e-10 and rel(dg, want[1]) < 1e-10


def test_refuses_bad_documents_and_shapes():
    q, k, v, g, beta, _ = make(1, 20, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="sum to T"):
        gated_delta_rule(q, k, v, g, beta, doc_lens=(10, 9))
    with pytest.raises(ValueError, match="positive"):
        gated_delta_rule(q, k, v, g, beta, doc_lens=(20, 0))
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])


def test_benchmark_case_runs():
    """bench/bench_delta_rule.py's case in this process at a small shape: it runs and counts the
    output and the gradients in its live peak (no timing is checked)."""
    from bench.bench_delta_rule import run_case

    shape = {"b": 1, "hk": 1, "hv": 2, "dk": 16, "dv": 16}
    r = run_case("ours", 512, shape, dr.BLOCK_CHUNKS, min_time_s=0.0)
    out_and_grads = 512 * (2 * 1 * 16 + 2 * 2 * 16 + 2 * 2) * 4  # out, dq, dk, dv, dg, dbeta
    assert r["live_peak_mb"] * 1e6 >= out_and_grads and r["time_s"] > 0
