"""--documents masked through train.py against transformers run on each document by itself.

Two rows of 64 + 1 tokens, each a few documents ending in the end-of-text id: row 0 has a
one-token document and boundaries exactly at the sp shard boundaries (16, 32, 48) and one
spanning 48, row 1 a document spanning 32 and a run of three lone eos tokens (best-fit's padding,
which attention takes as one segment); the last document of each row is cut by the row's end.
The reference is transformers' Qwen3ForCausalLM run on every document alone (positions from 0,
nothing else to attend to), the loss summed over every label inside a
document (the label after an eos is a next document's first token: not counted) and divided by
their count, and the gradient of that. Every layout's first step must give its loss and gradient
norm within 1e-6: 1 process, sp 2 with offload, a tiled MLP and attention once, sp 4 with kv
heads repeated, sp 2 with --cpu-offload, dp 2 x sp 2 with and without attention once.
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed, run_train
from hf_ref import hf_model, save_hf
from test_train import CFG, _common, eval_records, metrics

from data.documents import even_documents, row_documents
from memory.model_size import step_flops
from model.config import PRESETS
from model.ulysses_exchange import shard_row

EOS = CFG.vocab_size - 1  # the end-of-text id; no other token takes it
T = 64
# Each row's documents by length (tokens, the eos included); the last is cut by the row's end.
ROW_DOCS = [
    [5, 1, 10, 16, 7, 13, 12],  # ends at 5, 6, 16, 32 (sp 2 and 4), 39, 52: [39, 52) spans 48
    [20, 25, 1, 1, 1, 16],  # [20, 45) spans 32; three lone eos (one segment); 48 exact again
]


def make_row(rng, lengths: list[int]) -> np.ndarray:
    """T + 1 ids: each document random ids then the eos, the last one running past T."""
    assert sum(lengths) == T
    parts = [np.append(rng.integers(0, EOS, n - 1), EOS) for n in lengths[:-1]]
    parts.append(rng.integers(0, EOS, lengths[-1] + 1))  # cut: its label at T continues it
    return np.concatenate(parts)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("documents")
    ref = hf_model(CFG, seed=3)
    save_hf(ref, str(d / "model"))
    rng = np.random.default_rng(0)
    rows = np.stack([make_row(rng, docs) for docs in ROW_DOCS])  # [2, T + 1]
    np.save(d / "tokens.npy", rows)
    return d, ref, rows


def per_document_sums(ref, row, lengths) -> tuple[torch.Tensor, int]:
    """transformers on each document of one row alone: (the loss summed, labels counted)."""
    loss_sum, count, start = 0.0, 0, 0
    for i, n in enumerate(lengths):
        ids = torch.as_tensor(row[start : start + n + 1], dtype=torch.long)  # with its next
        logits = ref(ids[None, :n]).logits[0]  # [n, vocab], positions 0 .. n-1
        # inside a document every token predicts the next; the eos's label is another
        # document's first token, except for the last document, which the row cuts
        counted = n if i == len(lengths) - 1 else n - 1
        loss_sum = loss_sum + F.cross_entropy(
            logits[:counted], ids[1 : counted + 1], reduction="sum"
        )
        count += counted
        start += n
    return loss_sum, count


def per_document_reference(ref, rows) -> tuple[float, float, int]:
    """transformers on each document alone: (loss, grad norm, labels counted)."""
    ref.zero_grad()
    loss_sum, count = 0.0, 0
    for row, lengths in zip(rows, ROW_DOCS, strict=True):
        row_sum, row_count = per_document_sums(ref, row, lengths)
        loss_sum, count = loss_sum + row_sum, count + row_count
    loss = loss_sum / count
    loss.backward()
    norm = torch.norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    return loss.item(), norm.item(), count


def test_shards_carry_the_documents_positions_labels_and_lengths(setup):
    """The loader's view of row 0 at sp 4: positions restart after each eos, the label after an
    eos is ignored, and every shard carries the lengths of the whole row's documents."""
    _, _, rows = setup
    doc_lens = row_documents(rows[0], EOS)
    shards = [shard_row(rows[0], r, 4, doc_lens=doc_lens) for r in range(4)]
    positions = torch.cat([s["position_ids"] for s in shards], 1)[0].tolist()
    labels = torch.cat([s["labels"] for s in shards], 1)[0]
    expected = [p for n in ROW_DOCS[0] for p in range(n)]
    assert positions == expected
    ignored = (labels == -100).nonzero().flatten().tolist()
    assert ignored == [4, 5, 15, 31, 38, 51]  # every eos of the row, the one-token document's too
    assert all(s["doc_lens"] == tuple(ROW_DOCS[0]) for s in shards)
    last = shard_row(rows[1], 1, 2, doc_lens=row_documents(rows[1], EOS))
    assert last["doc_lens"] == (20, 25, 3, 16)  # one eos run


def test_an_eos_as_the_last_input_leaves_the_last_label_alone():
    """The row's last label after an eos starts a document of its own: not predicted, and no
    input of it for attention; lengths that do not sum to the row's ids are refused."""
    row = np.array([3, 4, EOS, 5, EOS, 6])  # T = 5 inputs, then the last label
    doc_lens = row_documents(row, EOS)
    assert doc_lens == (3, 2, 1)
    batch = shard_row(row, 0, 1, doc_lens=doc_lens)
    assert batch["labels"].tolist() == [[4, EOS, -100, EOS, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["doc_lens"] == (3, 2)
    with pytest.raises(ValueError, match="summing to its 6 ids"):
        shard_row(row, 0, 1, doc_lens=(3, 2))


def test_document_lengths_held_in_a_tensor_or_an_array_are_read_as_ints():
    row = torch.tensor([1, 2, 3, EOS, EOS, EOS, 6, 7, 8])  # a run of two lone eos after a document
    lengths = torch.tensor([4, 1, 1, 3])
    for given in (lengths, lengths.numpy(), lengths.tolist()):
        assert shard_row(row, 1, 2, doc_lens=given)["doc_lens"] == (4, 2, 2)
    assert lengths.tolist() == [4, 1, 1, 3]  # the caller's tensor is left as it was


@pytest.mark.slow
def test_masked_documents_match_transformers_per_document(setup):
    d, ref, rows = setup
    loss, norm, count = per_document_reference(ref, rows)
    masked = ["--documents", "masked", "--eos-id", str(EOS)]
    runs = {  # name: (processes, extra flags); every run takes both rows in its step
        "1proc": (1, ["--sp", "1", "--grad-accum", "2"]),
        "sp2-offload-tiled-once": (
            2,
            ["--sp", "2", "--grad-accum", "2", "--offload", "--offload-min-bytes", "0"]
            + ["--tile-mlp", "16", "--save-attention"],
        ),
        "sp4-kv-repeat": (4, ["--sp", "4", "--grad-accum", "2"]),
        "sp2-cpu-offload": (2, ["--sp", "2", "--grad-accum", "2", "--cpu-offload"]),
        "dp2xsp2": (4, ["--sp", "2", "--no-save-attention"]),
        "dp2xsp2-offload-once": (
            4,
            ["--sp", "2", "--offload", "--offload-min-bytes", "0", "--save-attention"],
        ),
    }
    for name, (n, extra) in runs.items():
        out = d / name
        run_train(n, *_common(d, out), *masked, *extra, "--eval-every", "0")
        m = metrics(out)[0]
        print(
            f"{name}: loss {m['loss']:.8f} (transformers per document {loss:.8f}), "
            f"grad_norm {m['grad_norm']:.8f} ({norm:.8f}), {m['tokens']} labels"
        )
        assert m["tokens"] == count
        assert m["loss"] == pytest.approx(loss, rel=1e-6)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-6)


@pytest.mark.slow
def test_held_out_loss_by_position_counts_the_place_in_the_document(setup):
    """--eval-only at sp 2 on the same rows: the held-out loss is transformers' per document, and
    the buckets count each label by its token's position inside its document (RoPE is relative,
    so a position that does not restart changes no loss: the buckets are where it shows)."""
    d, ref, rows = setup
    loss, _, count = per_document_reference(ref, rows)
    out = d / "eval"
    flags = [
        "--model",
        str(d / "model"),
        "--eval-only",
        "--eval-data",
        f"tokens:{d / 'tokens.npy'}",
    ]
    flags += ["--eval-rows", "2", "--seq-len", str(T), "--sp", "2", "--dtype", "float32"]
    flags += ["--documents", "masked", "--eos-id", str(EOS), "--out", str(out)]
    run_train(2, *flags, "--loss-chunk", "16")
    (rec,) = eval_records(out)
    counted = []  # the position of every counted label's token inside its document
    for lengths in ROW_DOCS:
        for i, n in enumerate(lengths):
            counted += range(n if i == len(lengths) - 1 else n - 1)
    buckets = [[s, e, sum(s <= p < e for p in counted)] for s, e in ((0, 8), (8, 16), (16, 32))]
    print("eval", rec["eval_loss"], loss, [b[:2] + [b[3]] for b in rec["loss_by_position"]])
    assert rec["eval_tokens"] == count
    assert rec["eval_loss"] == pytest.approx(loss, rel=1e-6)
    assert [[s, e, n] for s, e, _, n in rec["loss_by_position"]] == buckets + [[32, 64, 0]]


def test_masked_documents_need_an_eos_id_for_token_files(setup, tmp_path):
    d, _, _ = setup
    p = run_train(1, *_common(d, tmp_path / "o"), "--documents", "masked", check=False)
    assert p.returncode == 2 and "pass --eos-id N" in p.stderr


def test_attention_flops_are_the_sum_of_the_squared_document_lengths():
    """step_flops' attention by documents: the sum of their squares, here written out."""
    lengths = even_documents(1_048_576, 95_000)
    assert sum(lengths) == 1_048_576 and lengths[-1] == 1_048_576 - 11 * 95_000
    c = PRESETS["qwen3-8b"]
    stream, docs = step_flops(c, 1_048_576), step_flops(c, 1_048_576, doc_len=95_000)
    ratio = sum(n * n for n in lengths) / 1_048_576**2
    assert docs["attention_fwd"] == pytest.approx(stream["attention_fwd"] * ratio, rel=1e-12)
    assert docs["dense_fwd"] == stream["dense_fwd"]


@pytest.mark.slow
def test_rehearsal_counts_the_attention_kernels_documents_run(tmp_path):
    """--rehearse --documents masked --doc-len: the kernels' FLOPs as torch's formulas count them
    on fake tensors (one attention call per document) against the planner's. What documents save
    (the stream's rehearsal less theirs) is what the planner says they save, within 1%; the
    totals differ by the same few dense FLOPs the stream's do. The documents' step 2 peak is
    the plan's within 1%, and the GPU terms it names are flash's variable-length backward's (a
    rank's 2 query heads on 1 kv head of 32, fp32): dk, dv expanded, 2 x 8,192 x 2 x 32 x 4 B,
    and 128 rows a document of its dq accumulator and delta, 6 x 128 x 2 x (32 + 1) x 4 B. The
    dry run prints the projection beside the stream's."""
    flags = ["--model", "tiny", "--data", "synthetic:copy", "--eos-id", "0", "--seq-len", "8192"]
    flags += ["--sp", "2", "--dtype", "float32"]
    docs = ["--documents", "masked", "--doc-len", "1500"]
    flops, records = {}, {}
    for name, extra in (("stream", []), ("documents", docs)):
        out = tmp_path / name
        run_train(1, *flags, *extra, "--rehearse", "--out", str(out), env={"WORLD_SIZE": "2"})
        with open(out / "rehearsal.json") as f:
            records[name] = json.load(f)
        flops[name] = records[name]["flops"]
    r = records["documents"]
    assert r["peak_bytes"]["step2"] == pytest.approx(r["planned_bytes"]["total"], rel=0.01)
    gpu = r["gpu_only_bytes"]
    assert gpu["flash's dk, dv expanded to the query heads"] == 2 * 8192 * 2 * 32 * 4
    padding = "flash's variable-length backward: 128 padding rows a document"
    assert gpu[padding] == 6 * 128 * 2 * 33 * 4
    assert padding not in records["stream"]["gpu_only_bytes"]
    print(flops)
    saved = {k: flops["stream"][k] - flops["documents"][k] for k in ("rehearsed", "planned")}
    assert saved["rehearsed"] == pytest.approx(saved["planned"], rel=0.01)
    assert saved["planned"] > 0.7 * flops["stream"]["planned"]  # attention, most of the stream's
    off = [flops[k]["planned"] - flops[k]["rehearsed"] for k in flops]
    assert off[0] == pytest.approx(off[1], rel=0.01)
    p = run_train(1, *flags, *docs, "--dry-run", env={"WORLD_SIZE": "2"})
    assert "documents of 1,500 tokens (--documents masked: 6 per row of 8,192 tokens)" in p.stdout


def _ulysses_documents(rank, world, row, doc_lens):
    """The copyable Ulysses piece on a transformers model, with document lengths: (loss, grads)."""
    import torch.distributed as dist

    from model.ulysses_exchange import register_ulysses

    model = hf_model(CFG, seed=3)
    group = dist.group.WORLD
    model.set_attn_implementation(register_ulysses(group))
    batch = shard_row(torch.as_tensor(row), rank, world, doc_lens=doc_lens)  # T + 1 ids
    mine, positions, targets = batch["input_ids"], batch["position_ids"], batch["labels"]
    hidden = model.model(input_ids=mine, position_ids=positions, doc_lens=batch["doc_lens"])
    logits = model.lm_head(hidden.last_hidden_state)[0]  # [T/sp, vocab]
    count = torch.tensor(float((targets != -100).sum()))
    dist.all_reduce(count)
    loss = F.cross_entropy(logits, targets[0], ignore_index=-100, reduction="sum") / count
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("sp", [2, 4])
def test_copyable_ulysses_piece_takes_document_lengths(setup, sp):
    """model/ulysses_exchange.py on transformers' model with doc_lens against that model run on
    each document alone: row 0's T + 1 ids, its lengths with the last label in the last one."""
    _, ref, rows = setup
    doc_lens = (*ROW_DOCS[0][:-1], ROW_DOCS[0][-1] + 1)  # summing to T + 1
    ref.zero_grad()
    loss_sum, count = per_document_sums(ref, rows[0], ROW_DOCS[0])
    (loss_sum / count).backward()
    loss, grads = run_distributed(_ulysses_documents, sp, rows[0], doc_lens)[0]
    print(f"sp {sp}: loss {loss:.8f} (transformers per document {loss_sum.item() / count:.8f})")
    assert loss == pytest.approx(loss_sum.item() / count, rel=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)


def test_mfu_counts_each_rows_documents():
    """train.py's MFU FLOPs from the rows' own documents equal step_flops by document length."""
    import train
    from data.loader import RowLoader

    row = np.concatenate([np.append(np.ones(15, dtype=np.int64), EOS) for _ in range(4)] + [[1]])
    loader = RowLoader(np.stack([row, row]), eos_id=EOS)  # documents of 16 in rows of 64
    per_row = step_flops(CFG, T, attn_bwd_factor=2.0)
    by_length = step_flops(CFG, T, attn_bwd_factor=2.0, doc_len=16)["model"]
    assert train.model_flops(per_row, loader, 2) == pytest.approx(2 * by_length, rel=1e-12)
    assert by_length < per_row["model"]
    loader.eos_id = None  # stream: the row's square
    assert train.model_flops(per_row, loader, 2) == 2 * per_row["model"]
