"""The two ways model/attention.py runs a row of documents, on CPU, with the CUDA ops replaced.

varlen: every document of a row in one call of flash attention with cumulative lengths. Its CUDA
ops (aten._flash_attention_forward / _backward) are replaced here by a reference written from
plain torch math that takes and returns what the CUDA ops do (packed [tokens, heads, head_dim],
an int32 cum_seq, lse [heads, tokens]). Checked against F.scaled_dot_product_attention on each
document alone and against the per-segment path; a row of 1,000 documents of distinct lengths
makes one forward and one backward call per layer.

segments: the stream's kernel once per document. cuDNN's op is replaced by a stub that refuses
s_kv == 1 as cuDNN does; rows that start with an end-of-text id, hold a one-id document and end
in a two-id document (each makes a one-token segment) train through it at 1 process, sp 2 and
sp 4, equal to transformers run on each document alone within 1e-6 (fp32).
"""

import dataclasses
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from hf_ref import hf_model
from test_documents import per_document_sums
from test_train import CFG

import model.attention as attention_module
from model.attention import AttentionStore, attention
from model.qwen3 import Qwen3
from model.ulysses_exchange import shard_row

aten = torch.ops.aten


# ---- references for the CUDA ops -------------------------------------------------------------
def causal_reference(q, k, v):
    """Causal attention of one sequence by plain math: q [h, n, d], k, v [hkv, n, d] ->
    (out [h, n, d], lse [h, n]); query heads g*r .. g*r+g-1 share kv head r."""
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    n = q.shape[1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, -1)
    return torch.softmax(s, -1) @ v, lse


def _documents(cum, total, longest):
    """[(start, end)] from flash's cum_seq, which must be int32, start at 0, end at the total."""
    assert cum.dtype == torch.int32 and cum[0] == 0 and cum[-1] == total
    bounds = list(zip(cum[:-1].tolist(), cum[1:].tolist(), strict=True))
    assert longest == max(e - s for s, e in bounds)
    return bounds


class FlashVarlenReference:
    """aten._flash_attention_forward / _backward with cumulative lengths, in plain torch math,
    counting calls."""

    def __init__(self):
        self.forwards = self.backwards = 0

    def forward(self, q, k, v, cum_q, cum_k, max_q, max_k, dropout, causal, debug, **kw):
        assert cum_q is cum_k and max_q == max_k and dropout == 0.0 and causal and not debug
        self.forwards += 1
        out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        if q.dtype == torch.float64:
            lse = lse.double()
        for s, e in _documents(cum_q, q.shape[0], max_q):
            o, l_seg = causal_reference(*(t[s:e].transpose(0, 1) for t in (q, k, v)))
            out[s:e], lse[:, s:e] = o.transpose(0, 1), l_seg
        seed, offset = torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        return out, lse, seed, offset, torch.empty(0)

    def backward(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, drop, causal, *rng):
        """The flash backward's formula from the (out, lse) handed back: p = exp(s - lse)."""
        self.backwards += 1
        assert lse.shape == (q.shape[1], q.shape[0])  # [heads, tokens], as the forward gave it
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        g = q.shape[1] // k.shape[1]
        for s, e in _documents(cum_q, q.shape[0], max_q):
            qs, ks, vs, do, o = (t[s:e].transpose(0, 1) for t in (q, k, v, dout, out))
            ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
            scores = (qs @ ks.transpose(-1, -2)) * q.shape[-1] ** -0.5
            n = e - s
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
            p = torch.exp(scores - lse[:, s:e, None].to(scores.dtype))
            dp = do @ vs.transpose(-1, -2)
            ds = p * (dp - (do * o).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
            h = (k.shape[1], g, n, q.shape[-1])
            dq[s:e] = (ds @ ks).transpose(0, 1)
            dk[s:e] = (ds.transpose(-1, -2) @ qs).reshape(h).sum(1).transpose(0, 1)
            dv[s:e] = (p.transpose(-1, -2) @ do).reshape(h).sum(1).transpose(0, 1)
        return dq, dk, dv


@pytest.fixture
def flash_reference(monkeypatch):
    ref = FlashVarlenReference()
    monkeypatch.setattr(aten, "_flash_attention_forward", ref.forward)
    monkeypatch.setattr(aten, "_flash_attention_backward", ref.backward)
    return ref


def per_document(q, k, v, doc_lens):
    """F.scaled_dot_product_attention on each document alone; [B, T, heads, hd] in and out."""
    outs, start = [], 0
    for n in doc_lens:
        one = (t[:, start : start + n].transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(*one, is_causal=True, enable_gqa=True)
        outs.append(out.transpose(1, 2))
        start += n
    return torch.cat(outs, 1)


def _grads(fn, qkv, dout):
    qkv = [t.detach().requires_grad_() for t in qkv]
    out = fn(*qkv)
    return [out, *torch.autograd.grad(out, qkv, dout)]


# One-token documents first, between two others and last; the last one takes the row's padding.
DOC_LENS = (1, 6, 1, 9, 1, 1, 13, 1)


@pytest.mark.parametrize("batch", [1, 2])
def test_varlen_call_equals_each_document_alone_and_the_segments(flash_reference, batch):
    gen = torch.Generator().manual_seed(0)
    T = sum(DOC_LENS)
    q, dout = (torch.randn(batch, T, 4, 8, generator=gen, dtype=torch.float64) for _ in "ab")
    k, v = (torch.randn(batch, T, 2, 8, generator=gen, dtype=torch.float64) for _ in "ab")
    want = _grads(lambda *t: per_document(*t, DOC_LENS), (q, k, v), dout)
    kept = {}
    for documents in ("varlen", "segments"):
        store = AttentionStore()
        got = _grads(
            lambda *t, d=documents, s=store: attention(
                *t, backend="math", doc_lens=DOC_LENS, store=s, documents=d
            ),
            (q, k, v),
            dout,
        )
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"{documents} {name}")
        store.begin(replaying=True)
        kept[documents] = store.take()  # (out, lse) as attention once hands them back
    assert flash_reference.forwards == flash_reference.backwards == 1
    # attention once keeps the same (out, lse) whichever way the documents ran: lse [B, nh, T]
    assert kept["varlen"][1].shape == kept["segments"][1].shape == (batch, 4, T)
    torch.testing.assert_close(kept["varlen"][1], kept["segments"][1], rtol=1e-12, atol=1e-12)


def test_a_row_of_1000_documents_is_one_call_per_layer_and_direction(monkeypatch):
    """1,000 documents of distinct lengths (1 .. 1,000: 500,500 tokens) through a two-layer model
    on the pinned flash kernel: one varlen forward and one backward per layer. The ops are
    replaced by stand-ins that return what flash returns in shape (torch's own meta function's
    shapes), so only the calls are counted here; the numbers are the tests above."""
    calls = {"forward": [], "backward": []}

    def forward(q, k, v, cum_q, cum_k, max_q, max_k, *args, **kw):
        calls["forward"].append((cum_q.numel() - 1, max_q, q.shape[0]))
        lse = torch.zeros(q.shape[1], q.shape[0])
        return torch.zeros_like(q), lse, torch.zeros(2), torch.zeros(()), torch.empty(0)

    def backward(dout, q, k, v, out, lse, cum_q, *args):
        calls["backward"].append(cum_q.numel() - 1)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(aten, "_flash_attention_forward", forward)
    monkeypatch.setattr(aten, "_flash_attention_backward", backward)
    monkeypatch.setattr(attention_module, "_PINNED", "flash")  # what train.py pins on a GPU
    monkeypatch.setattr(attention_module, "_DOCUMENTS_PINNED", "varlen")
    lengths = tuple(range(1, 1001))
    cfg = dataclasses.replace(CFG, hidden_size=4, intermediate_size=4, head_dim=2)
    cfg = dataclasses.replace(cfg, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = Qwen3(cfg)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.zeros_like(positions)
    model(ids, positions, doc_lens=lengths).sum().backward()
    layers = cfg.num_hidden_layers
    assert calls["forward"] == [(1000, 1000, sum(lengths))] * layers
    assert calls["backward"] == [1000] * layers


# ---- cuDNN's refusal of one-token segments --------------------------------------------------
def cudnn_stub_forward(q, k, v, bias, log_sumexp, dropout, causal, debug, **kw):
    """aten._scaled_dot_product_cudnn_attention by plain math, refusing one key as cuDNN does."""
    if k.shape[2] == 1:
        raise RuntimeError("cuDNN Frontend error: s_q = s_kv = 1 is not supported")
    rows = [causal_reference(q[b], k[b], v[b]) for b in range(q.shape[0])]
    out = torch.stack([o for o, _ in rows])
    lse = torch.stack([lse for _, lse in rows])[..., None]  # [B, nh, T, 1]
    nothing = torch.empty(0)
    return out, lse, nothing, nothing, q.shape[2], k.shape[2], nothing, nothing, nothing


def cudnn_stub_backward(dout, q, k, v, out, lse, seed, offset, bias, *rest):
    if k.shape[2] == 1:
        raise RuntimeError("cuDNN Frontend error: s_q = s_kv = 1 is not supported")
    qkv = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = torch.stack([causal_reference(*(t[b] for t in qkv))[0] for b in range(q.shape[0])])
        return torch.autograd.grad(out, qkv, dout)


def _pin_refusing_cudnn():
    """In this process: cuDNN pinned, its ops the refusing stubs, documents run per segment."""
    aten._scaled_dot_product_cudnn_attention = cudnn_stub_forward
    aten._scaled_dot_product_cudnn_attention_backward = cudnn_stub_backward
    attention_module.set_backend("cudnn")
    attention_module.set_documents_kernel("segments")


EOS = CFG.vocab_size - 1
# ids per document, summing to T + 1 = 33: an eos first, a one-id document between two others,
# a two-id document last (its one input is the row's last token): three one-token segments
ROW_DOCS = (1, 7, 1, 9, 6, 7, 2)


def _row():
    rng = np.random.default_rng(5)
    parts = [np.append(rng.integers(0, EOS, n - 1), EOS) for n in ROW_DOCS[:-1]]
    return np.concatenate([*parts, rng.integers(0, EOS, ROW_DOCS[-1])])


def _our_step(ref_state, row, group, rank: int, sp: int):
    """Our Qwen3 (transformers' weights) on this rank's share of the row: (loss, grads), the loss
    the sum over labels over their count, every gradient summed over the sp group."""
    import torch.distributed as dist

    from model.ulysses import UlyssesAttention

    model = Qwen3(CFG)
    model.load_state_dict(ref_state)
    if sp > 1:
        model.set_attention(UlyssesAttention(group))
    batch = shard_row(torch.as_tensor(row), rank, sp, doc_lens=ROW_DOCS, ignore_index=-100)
    assert 1 in batch["doc_lens"]  # one-token segments do reach attention
    hidden = model(batch["input_ids"], batch["position_ids"], doc_lens=batch["doc_lens"])
    labels = batch["labels"][0]
    count = torch.tensor(float((labels != -100).sum()))
    loss = F.cross_entropy(model.lm_head(hidden)[0], labels, ignore_index=-100, reduction="sum")
    if sp > 1:
        dist.all_reduce(count, group=group)
    (loss / count).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    loss = (loss / count).detach()
    if sp > 1:
        for g in [*grads.values(), loss]:
            dist.all_reduce(g, group=group)
    return loss.item(), grads


def _sp4_and_sp2(rank, world, ref_state, row):
    """One launch of 4 processes: the row at sp 4, then at sp 2 on ranks {0, 1} and {2, 3}."""
    import torch.distributed as dist

    _pin_refusing_cudnn()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {
        "sp4": _our_step(ref_state, row, dist.group.WORLD, rank, 4),
        "sp2": _our_step(ref_state, row, pairs[rank // 2], rank % 2, 2),
    }


@pytest.mark.slow
def test_one_token_documents_train_past_a_kernel_that_refuses_them():
    ref = hf_model(CFG, seed=3)
    row = _row()
    assert len(row) == 33 and row[0] == EOS
    lengths = (*ROW_DOCS[:-1], ROW_DOCS[-1] - 1)  # per_document_sums': the last one's inputs
    loss_sum, count = per_document_sums(ref, row, lengths)
    (loss_sum / count).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    state = {n: t.clone() for n, t in ref.state_dict().items()}
    with pytest.MonkeyPatch.context() as mp:  # one process, here
        mp.setattr(aten, "_scaled_dot_product_cudnn_attention", cudnn_stub_forward)
        mp.setattr(aten, "_scaled_dot_product_cudnn_attention_backward", cudnn_stub_backward)
        mp.setattr(attention_module, "_PINNED", "cudnn")
        mp.setattr(attention_module, "_DOCUMENTS_PINNED", "segments")
        runs = {"1proc": _our_step(state, row, None, 0, 1)}
    results = run_distributed(_sp4_and_sp2, 4, state, row)
    runs.update(sp4=results[0]["sp4"], sp2=results[0]["sp2"], sp2b=results[2]["sp2"])
    for name, (loss, grads) in runs.items():
        print(f"{name}: loss {loss:.8f} (transformers per document {(loss_sum / count):.8f})")
        assert loss == pytest.approx((loss_sum / count).item(), rel=1e-6)
        for n, g in want.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-6, atol=1e-7, msg=f"{name} {n}")


# ---- choosing how documents run -------------------------------------------------------------
def test_documents_are_probed_with_one_token_documents_and_refused_in_one_line(
    flash_reference, monkeypatch
):
    """choose_documents_kernel as train.py runs it on a GPU (varlen first where flash takes the
    heads; here documents_kernel is told so): varlen when its probe passes; segments, saying why,
    when flash hands back an lse in another layout; the per-segment path past cuDNN's refusal of
    one-token documents; one line when nothing runs."""
    import functools

    import model.attention_probe as ap

    monkeypatch.setattr(ap, "documents_kernel", lambda *a: "varlen")
    lens = ap.probe_documents(ap.PROBE_TOKENS)
    assert sum(lens) == ap.PROBE_TOKENS and lens.count(1) >= 4 and lens[-1] == max(lens)
    probe = functools.partial(ap.probe_documents_kernel, backend="math")
    pick = functools.partial(ap.choose_documents_kernel, "cpu", torch.float32, CFG, 1200, 2)
    assert pick("math", probe=probe).name == "varlen" and flash_reference.forwards == 1

    real = flash_reference.forward

    def padded_lse(*args, **kw):  # older flash: lse [documents, heads, longest]
        out, lse, *rest = real(*args, **kw)
        return (out, lse.new_zeros(len(args[3]) - 1, lse.shape[0], args[5]), *rest)

    monkeypatch.setattr(aten, "_flash_attention_forward", padded_lse)
    choice = pick("math", probe=probe)
    assert choice.name == "segments"
    assert choice.why.startswith("varlen: RuntimeError: flash attention's variable-length log")

    monkeypatch.setattr(aten, "_scaled_dot_product_cudnn_attention", cudnn_stub_forward)
    monkeypatch.setattr(aten, "_scaled_dot_product_cudnn_attention_backward", cudnn_stub_backward)
    cudnn = functools.partial(ap.probe_documents_kernel, backend="cudnn")
    assert pick("cudnn", probe=cudnn).name == "segments"
    assert cudnn("segments", "cpu", torch.float32, 2, 1, 16, tokens=1200) is None

    with pytest.raises(ValueError) as e:
        pick("cudnn", probe=lambda name, *a, **k: f"{name} fails")
    assert "\n" not in str(e.value) and "varlen: varlen fails; segments: segments fails" in str(
        e.value
    )


def test_the_plan_counts_what_the_varlen_call_keeps_until_backward(flash_reference):
    """What the one call leaves on its autograd node for the backward (the cumulative lengths and
    flash's rng state, each a CUDA allocator block of 512 bytes or more) is what the planner
    counts per layer, Buffer.KEPT_DOCUMENTS, over every layer not yet in backward."""
    from memory.buffers import CUDA_SMALLEST_BLOCK, Buffer, documents_state_bytes
    from memory.plan import plan
    from model.config import Qwen3Config

    seq_len, doc_len = 8192, 1500
    lens = (*[doc_len] * (seq_len // doc_len), seq_len % doc_len)
    q, k, v = (torch.randn(1, seq_len, 1, 8, dtype=torch.float64) for _ in "qkv")
    out = attention(q.requires_grad_(), k, v, backend="flash", doc_lens=lens, documents="varlen")
    node = out.grad_fn.next_functions[0][0]  # attention()'s transpose, then the core's node
    kept = [t for t in node.aux if isinstance(t, torch.Tensor)]
    blocks = sum(max(-(-t.nbytes // CUDA_SMALLEST_BLOCK), 1) for t in kept)
    assert kept[0].tolist() == [0, *itertools.accumulate(lens)]  # the cumulative lengths
    per_layer = documents_state_bytes(len(lens))
    assert per_layer == blocks * CUDA_SMALLEST_BLOCK
    c = Qwen3Config.preset("qwen3-8b")
    kw = dict(gpus=8, sp=8, save_attention=True, device="cuda")
    p = plan(c, seq_len, doc_len=doc_len, **kw)
    counted = max(m.working.get(Buffer.KEPT_DOCUMENTS, 0) for m in p.moments)
    assert counted == c.num_hidden_layers * per_layer
    stream = plan(c, seq_len, **kw)  # the same moments, less the documents' blocks
    varlen = (Buffer.FLASH_GQA_GRADS, Buffer.DOCUMENTS_PADDING, Buffer.FLASH_WORKSPACE)
    for m, n in zip(p.moments, stream.moments, strict=True):
        if m.name == "attention backward":  # and the varlen backward's buffers, tested below
            m = dataclasses.replace(m, working={**m.working, **{b: 0 for b in varlen}})
            n = dataclasses.replace(n, working={**n.working, Buffer.CUDNN_WORKSPACE: 0})
        assert m.bytes - n.bytes == m.working.get(Buffer.KEPT_DOCUMENTS, 0)
    assert documents_state_bytes(len(lens), "cpu") == 0  # segments keep nothing


def test_the_plan_counts_the_varlen_backward_a_gpu_runs_documents_on():
    """A row of documents runs flash's variable-length backward on a GPU whatever the stream's
    kernel. Its buffers, from flash-attention's mha_varlen_bwd (csrc/flash_attn/flash_api.cpp):
    dk_expanded and dv_expanded [total_k, num_heads, head_size] when num_heads_k != num_heads,
    dq_accum [total_q + 128 x batch, num_heads, head_size_rounded] fp32 and softmax_d
    [num_heads, total_q + 128 x batch] fp32. Qwen3-8B at sp 8 has 4 query heads and 1 kv head
    a rank: 1 GiB each for dk and dv at 1,048,576 tokens, and 128 x 4 x (128 + 1) x 4 = 264,192
    bytes a document (258 KiB, the issue's figure). Qwen3-30B-A3B at 1M, whose attention backward
    is its largest moment, plans its peak higher by them; Qwen3-8B's MLP backward stays larger."""
    from memory.buffers import Buffer
    from memory.choices import plan_for_run
    from memory.plan import plan
    from model.config import Qwen3Config
    from run.train_config import TrainConfig

    kw = dict(gpus=8, sp=8, save_attention=True, mlp_tile=16384, attn_backend="cudnn")
    c = Qwen3Config.preset("qwen3-8b")
    docs = plan(c, 2**20, doc_len=4096, **kw)
    attn = next(m for m in docs.moments if m.name == "attention backward")
    assert attn.working[Buffer.FLASH_GQA_GRADS] == 2 * 2**30
    assert attn.working[Buffer.DOCUMENTS_PADDING] == 256 * 264_192
    assert attn.working[Buffer.FLASH_WORKSPACE] == 2**20 * 4 * 129 * 4
    stream = plan(c, 2**20, **kw)
    assert all(Buffer.FLASH_GQA_GRADS not in m.working for m in stream.moments)  # cuDNN's
    kept = docs.peak.working.get(Buffer.KEPT_DOCUMENTS, 0)  # the cumulative lengths: KiB
    assert docs.peak.name == "MLP backward" and docs.total - stream.total == kept

    moe = Qwen3Config.preset("qwen3-30b-a3b")  # 32 query heads, 4 kv heads: 4 and 1 a rank
    docs, stream = plan(moe, 2**20, doc_len=4096, **kw), plan(moe, 2**20, **kw)
    assert docs.peak.name == stream.peak.name == "attention backward"
    rise = 2 * 2**20 * 4 * 128 * 2 + 256 * 264_192  # dk, dv expanded; the documents' padding
    kept = docs.peak.working.get(Buffer.KEPT_DOCUMENTS, 0)
    assert docs.total - stream.total == rise + kept  # cuDNN's workspace is projected as flash's

    # a run reads its rows' documents as it goes: planned at one per 256 tokens
    cfg = dataclasses.replace(TrainConfig(), documents="masked", seq_len=2**20, doc_len=0)
    p = plan_for_run(cfg, c, 8, 8, 1, torch.bfloat16, "cuda")
    attn = max((m for m in p.moments if m.name == "attention backward"), key=lambda m: m.bytes)
    assert attn.working[Buffer.DOCUMENTS_PADDING] == 4096 * 264_192
    assert attn.working[Buffer.FLASH_GQA_GRADS] == 2 * 2**30


def test_a_rows_cumulative_lengths_are_copied_to_the_device_once(flash_reference, monkeypatch):
    """The cumulative lengths go to the device once a row (on CUDA from pinned memory, without
    blocking): every layer's forward, a recompute that runs attention again and one that takes
    it from attention once, and every backward take the same tensor. Two rows, two layers each
    way, and a repeat of the second row's lengths: two copies."""
    from model.checkpoint_offload import LayerPlacement, apply_offload

    copies = []
    real = attention_module._lengths_to_device
    monkeypatch.setattr(
        attention_module, "_lengths_to_device", lambda h, d: copies.append(h.tolist()) or real(h, d)
    )
    monkeypatch.setattr(attention_module, "_PINNED", "math")
    monkeypatch.setattr(attention_module, "_DOCUMENTS_PINNED", "varlen")
    monkeypatch.setattr(attention_module, "_ROW_LENGTHS", [])
    cfg = dataclasses.replace(CFG, num_hidden_layers=4)
    torch.manual_seed(0)
    model = Qwen3(cfg).double()
    recompute, keep = LayerPlacement("device", "recompute"), LayerPlacement("device", "device")
    apply_offload(model, offload=False, placements=[recompute, keep, recompute, keep])
    rows = [(5, 1, 10), (3, 13), (3, 13)]
    for lens in rows:
        positions = torch.cat([torch.arange(n) for n in lens])[None]
        model(torch.ones_like(positions), positions, doc_lens=lens).sum().backward()
    assert copies == [[0, 5, 6, 16], [0, 3, 16]]
    layers = cfg.num_hidden_layers
    # each layer's forward once, the two recomputed layers' again; a backward per layer and row
    assert flash_reference.forwards == len(rows) * (layers + 2)
    assert flash_reference.backwards == len(rows) * layers
