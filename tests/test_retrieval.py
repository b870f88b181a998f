"""Retrieval evaluation (data/retrieval.py, run/retrieval.py) against transformers.

* every case train.py scored (read back from OUT/retrieval_cases.jsonl: the prompt's and the
  answer's ids) has transformers' Qwen3ForCausalLM answer log-prob within 1e-5 (fp32), and
  its count of answer tokens that are the argmax, at 1 process, sp 2, sp 4 and dp 2 x sp 2,
  with --eval-only on the synthetic filler and at step 0 of a run on held-out token rows;
* the records' accuracies are the same at every layout;
* cases are exactly their length, the needle sits at its depth, the answer is the key;
* lengths that cannot hold a case are refused; the text grid has the picture's numbers;
* a tiny model trained on --data synthetic:passkey goes from 0 to at least 0.9 accuracy, read
  from the run's records, and scores the same at sp 2 (the needle on rank 0, the question on
  rank 1);
* the retrieval evaluation's measured peak is the plan's within 5% at sp 2 and dp 2 x sp 2.
"""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from dist_utils import run_train
from hf_ref import hf_model, save_hf
from test_train import CFG, eval_records

from data.retrieval import CHARS, DEPTHS, RetrievalCases, char_vocab, default_lengths

SEQ = 512  # passkey at 128, 256, 512; kv (longer needles) at 256, 512
# 12 ids: CHARS' 68 characters share them, so a random model's argmax is an answer token often
# enough (about 1 in 12) for the argmax count to be checked, not only zeros.
MODEL = replace(CFG, vocab_size=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("retrieval")
    ref = hf_model(MODEL, seed=3)
    save_hf(ref, str(d / "model"))
    rows = np.random.default_rng(1).integers(0, MODEL.vocab_size, size=(4, SEQ + 1))
    np.save(d / "tokens.npy", rows)
    return d, ref


def reference(ref, line) -> tuple[float, int]:
    """transformers: the answer's log-prob after the prompt, and its tokens that are the argmax."""
    prompt, answer = line["prompt"], line["answer"]
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logits = ref(ids[:, :-1]).logits[0].double()  # [L, V]
    at = torch.arange(len(prompt) - 1, ids.shape[1] - 1)  # the inputs whose labels are answers
    logp = torch.log_softmax(logits[at], -1).gather(1, ids[0, at + 1, None]).sum()
    hits = (logits[at].argmax(-1) == ids[0, at + 1]).sum()
    return logp.item(), int(hits)


def cases(out, step=0) -> list[dict]:
    with open(out / "retrieval_cases.jsonl") as f:
        return [x for x in map(json.loads, f) if x["step"] == step]


def check_against_transformers(ref, lines) -> float:
    worst = 0.0
    for line in lines:
        assert len(line["prompt"]) + len(line["answer"]) == line["length"] + 1
        logp, hits = reference(ref, line)
        worst = max(worst, abs(line["logprob"] - logp))
        assert line["logprob"] == pytest.approx(logp, abs=1e-5), (line["task"], line["index"])
        assert line["answer_tokens"] == len(line["answer"])
        assert line["answer_hits"] == hits, (line["task"], line["index"])
        assert line["correct"] == (hits == len(line["answer"]))
    return worst


def flags(d, out):
    return [
        "--model", str(d / "model"), "--seq-len", str(SEQ), "--dtype", "float32",
        "--loss-chunk", "16", "--out", str(out), "--eval-task", "passkey", "--eval-task", "kv",
    ]  # fmt: skip


@pytest.mark.slow
def test_answer_logprobs_are_transformers_at_every_layout(model_dir):
    d, ref = model_dir
    layouts = {  # name: (processes, flags)
        "1proc": (1, ["--sp", "1", "--eval-only"]),
        "sp2": (2, ["--sp", "2", "--eval-only"]),
        "sp4-kv-repeat": (4, ["--sp", "4", "--eval-only"]),
        # step 0 of a run on the token file: the haystacks are its held-out rows (2 and 3)
        "dp2xsp2-run": (4, ["--sp", "2", "--data", f"tokens:{d / 'tokens.npy'}", "--steps", "1"]),
    }
    accuracy = {}
    for name, (n, more) in layouts.items():
        out = d / name
        p = run_train(n, *flags(d, out), *more, "--no-save-final")
        lines = cases(out)
        assert len(lines) == 30 + 20  # 3 x 5 x 2 passkey cases, 2 x 5 x 2 kv cases
        worst = check_against_transformers(ref, lines)
        hits = sum(x["answer_hits"] for x in lines)
        recs = [r for r in eval_records(out) if r["step"] == 0]
        assert [r["eval_task"] for r in recs] == ["passkey", "kv"]
        assert set(recs[0]) == {
            "step", "eval", "eval_task", "accuracy", "answer_logprob", "cases", "by_length_depth",
            "eval_time_s", "eval_peak_mem_gb", "eval_planned_peak_gb",
        }  # fmt: skip
        accuracy[name] = [[c[2] for c in r["by_length_depth"]] for r in recs]
        print(f"{name}: worst |logprob - transformers'| {worst:.2e}, {hits} answer hits")
        assert hits > 0
        assert "eval passkey at step 0 | accuracy" in p.stdout
    assert all(a == accuracy["1proc"] for a in accuracy.values()), accuracy
    deep = [x for x in cases(d / "dp2xsp2-run") if x["length"] == SEQ and x["depth"] == 1.0]
    haystack = deep[0]["prompt"][:64]  # depth 1: the needle last, 400 filler ids first
    rows = np.load(d / "tokens.npy")[2:]
    assert any(haystack == r[s : s + 64].tolist() for r in rows for s in range(SEQ - 63)), (
        "the haystack is not a slice of the held-out rows"
    )


def test_cases_fit_their_length_and_hide_the_key_at_its_depth():
    vocab = char_vocab(len(CHARS))  # one id per character: ids decode back to text
    for task in ("passkey", "kv"):
        made = RetrievalCases(task, vocab, [256, 512], DEPTHS, per_cell=2, seed=5)
        for i in range(len(made)):
            c = made[i]
            assert len(c.ids) == c.length + 1 and made.cell(i) == (c.length, c.depth)
            text = "".join(CHARS[x] for x in c.ids)
            answer = "".join(CHARS[x] for x in c.answer)
            needle = f"The pass key is{answer}." if task == "passkey" else f" is{answer}."
            question = text.rindex("\nWhat is")
            assert needle in text[:question], (task, i)
            where = text.index(needle) if task == "passkey" else None
            if task == "passkey":  # the share of the haystack before the needle is the depth
                hay = question - len(needle) - len(" Remember it. ")
                assert abs(where - c.depth * hay) <= 1, (i, where, c.depth, hay)
    again = RetrievalCases("passkey", vocab, [256], [0.5], per_cell=3, seed=5)
    assert [again[i].ids.tolist() for i in range(3)] == [
        RetrievalCases("passkey", vocab, [256], [0.5], per_cell=3, seed=5)[i].ids.tolist()
        for i in range(3)
    ]
    assert default_lengths(512) == [128, 256, 512]
    assert default_lengths(1 << 20)[:2] == [4096, 8192] and default_lengths(1 << 20)[-1] == 1 << 20
    assert default_lengths(512, shortest=200) == [256, 512]


def test_lengths_that_cannot_hold_a_case_are_refused(model_dir, tmp_path):
    d, _ = model_dir
    base = [*flags(d, tmp_path / "o"), "--eval-only"]
    p = run_train(1, *base, "--eval-lengths", "64", check=False)
    assert p.returncode == 2 and "--eval-task passkey" in p.stderr and "at least" in p.stderr
    p = run_train(1, *base, "--eval-lengths", "1k", check=False)
    assert p.returncode == 2 and "--eval-lengths 1k: must be" in p.stderr, p.stderr


def test_text_grid_has_the_picture_numbers():
    from run.retrieval import text_grid

    rec = {
        "step": 0,
        "by_length_depth": [
            [128, 0.0, 0.5, -3.0, 2],
            [256, 0.0, 1.0, -1.0, 2],
            [128, 1.0, 0.0, -9, 2],
        ],
    }
    lines = text_grid("passkey", rec)
    assert lines[1].split() == ["depth", "128", "256"]
    assert lines[2].split() == ["0", "0.50", "1.00"] and lines[3].split() == ["1", "0.00", "-"]


def test_a_tokenizer_and_held_out_text_make_the_cases(tmp_path):
    """A model directory with a (BPE) tokenizer, --eval-data a text file: the needle, question and
    answer are the tokenizer's ids, the haystack is the held-out text, and the log-probs are
    transformers'."""
    from test_data import _make_books, _train_tokenizer
    from transformers import AutoTokenizer

    books = _make_books(n=12, seed=4)
    model = tmp_path / "model"
    _train_tokenizer(books, model)
    tok = AutoTokenizer.from_pretrained(model)
    ref = hf_model(replace(CFG, vocab_size=len(tok)), seed=3)
    save_hf(ref, str(model))
    (tmp_path / "books.txt").write_text("\n\n".join(books))
    out = tmp_path / "eval"
    run_train(
        1, "--model", str(model), "--eval-only", "--eval-task", "passkey", "--seq-len", "256",
        "--eval-data", str(tmp_path / "books.txt"), "--dtype", "float32", "--out", str(out),
        "--cache-dir", str(tmp_path / "cache"), "--eval-depths", "0.5", "--eval-cases", "3",
    )  # fmt: skip
    lines = cases(out)
    assert [x["length"] for x in lines] == [128] * 3 + [256] * 3
    check_against_transformers(ref, lines)
    for x in lines:
        prompt, answer = tok.decode(x["prompt"]), tok.decode(x["answer"])
        assert answer[0] == " " and answer[1:].isdigit() and 5 <= len(answer) - 1 <= 7
        assert f"The pass key is{answer}. Remember it." in prompt
        assert prompt.endswith("\nWhat is the pass key? The pass key is")
        hay = prompt.split()
        assert sum(w in hay for w in ("ship", "sailed", "north", "saw", "ice", "wrote", "sea")) >= 2


@pytest.mark.slow
def test_retrieval_peak_is_the_planned_evaluation_peak(tmp_path):
    """2 ranks, sp 2, rows of 2048 tokens, the meter on: the retrieval evaluation's measured peak
    is the evaluation's plan within the planner's 5% (0.02% under it on torch 2.13, 2.5% over on
    2.11), and the loss evaluation's within 2% (its longest case is a row; the answer's logits
    are a few rows)."""
    out = tmp_path / "run"
    run_train(
        2, "--eval-only", "--model", "tiny", "--eval-data", "synthetic:copy", "--seq-len", "2048",
        "--sp", "2", "--dtype", "float32", "--tile-mlp", "256", "--measure-memory",
        "--eval-task", "passkey", "--eval-task", "loss", "--eval-cases", "1", "--out", str(out),
    )  # fmt: skip
    passkey, loss = eval_records(out)
    assert passkey["eval_task"] == "passkey" and "eval_task" not in loss
    print(
        f"measured: passkey {passkey['eval_peak_mem_gb'] * 1e3:.4f} MB, loss "
        f"{loss['eval_peak_mem_gb'] * 1e3:.4f} MB; planned "
        f"{loss['eval_planned_peak_gb'] * 1e3:.4f} MB"
    )
    assert passkey["eval_peak_mem_gb"] == pytest.approx(passkey["eval_planned_peak_gb"], rel=0.05)
    assert passkey["eval_peak_mem_gb"] == pytest.approx(loss["eval_peak_mem_gb"], rel=0.02)


def test_dry_run_projects_the_retrieval_time():
    """--dry-run's line per retrieval task: the recipe's default grid is 9 lengths x 5 depths x 2;
    half the cases per cell is half the time, two dp groups share the cases, and a 1M case costs
    between 2x and 4x a 512k one (attention's T^2 against the matmuls' T)."""
    import re

    from model.config import Qwen3Config as Config
    from run.offline import retrieval_time
    from train import parse_args

    mc = Config.preset("qwen3-8b").with_yarn(32, 32768)

    def seconds(*flags, dp=1):
        cfg = parse_args(["--preset", "qwen3-8b-1m", "--eval-task", "passkey", *flags])
        (line,) = retrieval_time(cfg, mc, 8, dp)
        return int(re.search(r"(\d+) cases", line).group(1)), float(
            re.search(r"about (\d+) s", line).group(1)
        )

    cases, full = seconds()
    print(f"qwen3-8b-1m, passkey: {cases} cases, {full:.0f} s per evaluation projected")
    assert cases == 9 * 5 * 2
    assert seconds("--eval-cases", "1")[1] == pytest.approx(full / 2, abs=1)
    assert seconds(dp=2)[1] == pytest.approx(full / 2, abs=1)
    one_m, half = seconds("--eval-lengths", "1M")[1], seconds("--eval-lengths", "512k")[1]
    assert 2 < one_m / half < 4
    assert retrieval_time(parse_args(["--preset", "qwen3-8b-1m"]), mc, 8, 1) == []


@pytest.mark.slow
def test_training_on_synthetic_passkey_takes_accuracy_from_chance_to_high(tmp_path):
    """--data synthetic:passkey: a tiny model trained in one process goes from about nothing at
    step 0 (a random init; 1 in 9 is a guess of the 1-digit key) to an accuracy of at least 0.9
    (every answer token the argmax, from the run's own records) in 200 steps of 8 rows (lr 3e-3,
    cosine). Its export, evaluated with --eval-only at sp 2, scores the same accuracy: the
    cases of 128 tokens keep the needle in rank 0's half and the question in rank 1's, so each
    right answer is read across the shards. (The training runs in one process: at sp 2 the same
    steps take three times as long on 2 cores, and the layouts' equality is the other tests'.)"""
    out, evaluated = tmp_path / "run", tmp_path / "eval"
    # 0.9 held from steps 70-140 over seeds 0-4 at 1 and 2 threads alike, 1.0 at step 200 in all
    # (docs/tests.md): the cap is 1.4 times the latest seed's need
    steps = 200
    task = [
        "--eval-task", "passkey", "--passkey-digits", "1", "--eval-lengths", "128",
        "--eval-depths", "0,0.25,0.5", "--eval-cases", "10", "--dtype", "float32",
    ]  # fmt: skip
    p = run_train(
        1, "--model", "tiny", "--data", "synthetic:passkey", "--seq-len", "128",
        "--steps", str(steps), "--grad-accum", "8", "--lr", "3e-3", "--loss-on", "predictable",
        "--save-every", "0", "--out", str(out), *task,
        timeout=1800,  # 40 s on an idle 2-core CPU, minutes on a busy one; it catches a hang
    )  # fmt: skip
    first, last = eval_records(out)
    assert (first["step"], last["step"]) == (0, steps) and first["cases"] == 30
    print(f"passkey accuracy: step 0 {first['accuracy']:.3f}, step {steps} {last['accuracy']:.3f}")
    assert first["accuracy"] <= 0.2
    assert last["accuracy"] >= 0.9
    assert f"eval passkey at step {steps} | accuracy" in p.stdout

    run_train(2, "--model", str(out / "final"), "--sp", "2", "--eval-only", "--out",
              str(evaluated), *task)  # fmt: skip
    (across,) = eval_records(evaluated)
    digits = set(char_vocab(512)("0123456789").tolist())
    for line in cases(evaluated):
        key_at = [i for i, x in enumerate(line["prompt"]) if x in digits]
        assert key_at and max(key_at) < 64 <= len(line["prompt"]) - 20, line["index"]
        assert line["answer"][-1] == line["prompt"][key_at[0]]  # the key, once, on rank 0
    print(f"sp 2: accuracy {across['accuracy']:.3f}; by depth (0, 0.25, 0.5): "
          f"{[round(c[2], 2) for c in across['by_length_depth']]}")  # fmt: skip
    assert across["cases"] == 30 and across["accuracy"] == pytest.approx(last["accuracy"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, more",
    [(2, ["--eval-only"]), (4, ["--eval-only"]), (2, ["--steps", "1", "--no-save-final"])],
    ids=["sp2", "dp2xsp2", "sp2-run"],
)
def test_retrieval_peak_is_held_to_the_meter(tmp_path, nproc, more):
    """--measure-memory, sp 2 on 2 processes and dp 2 x sp 2 on 4, rows of 2048 tokens: the
    retrieval evaluation's measured peak (memory/meter.py) is its planned peak within 5%: with
    --eval-only and at a run's step 0 without AdamW's states (eval_total_without_adamw), after a
    run's step with them (eval_total)."""
    out = tmp_path / "run"
    run_train(
        nproc, "--model", "tiny", "--seq-len", "2048", "--sp", "2", "--data", "synthetic:copy",
        "--dtype", "float32", "--tile-mlp", "256", "--measure-memory", "--eval-task", "passkey",
        "--eval-lengths", "2048", "--eval-depths", "0.5", "--eval-cases", "2", "--out", str(out),
        *more,
    )  # fmt: skip
    recs = eval_records(out)
    assert [r["step"] for r in recs] == ([0] if "--eval-only" in more else [0, 1])
    for rec in recs:
        measured, planned = rec["eval_peak_mem_gb"], rec["eval_planned_peak_gb"]
        print(f"{nproc} processes {more}, step {rec['step']}: measured {measured * 1e3:.4f} MB, "
              f"planned {planned * 1e3:.4f} MB")  # fmt: skip
        assert measured == pytest.approx(planned, rel=0.05)


def test_synthetic_passkey_rows_are_cases_with_the_answer_predictable():
    """build_rows("synthetic:passkey"): each row is a passkey case of seq_len inputs (a 1-digit
    key here), its predictable labels exactly the answer's, the needle's depth sweeping the row
    from row to row, and no training key sequence the same as the evaluation's (--seed's)."""
    from data import build_rows

    n = len(CHARS)  # one id per character: ids decode back to text
    rows = build_rows("synthetic:passkey", None, 128, 66, vocab_size=n, seed=0, key_digits=(1, 1))
    assert rows.shape == (66, 129) and rows.meta["key_digits"] == [1, 1]
    text = "".join(CHARS[x] for x in rows[5])
    mask = rows.predictable(5)
    answer = "".join(CHARS[x] for x in rows[5][1:][mask])
    assert len(answer) == 2 and answer[0] == " " and answer[1].isdigit()
    assert text.endswith(f"\nWhat is the pass key? The pass key is{answer}")
    assert f"The pass key is{answer}. Remember it. " in text
    assert mask.sum() == 2 and mask[-2:].all()
    where = [
        text.index("The pass key is")
        for text in ("".join(CHARS[x] for x in rows[i]) for i in range(33))
    ]
    needle = len(f"The pass key is{answer}. Remember it. ")
    last = "".join(CHARS[x] for x in rows[32])
    assert where == sorted(where) and where[0] == 0  # depth 0 .. 1 over rows 0 .. 32
    assert where[-1] + needle == last.rindex("\nWhat is")  # depth 1: right before the question
    train_keys = [rows[i][-1] for i in range(66)]
    vocab = char_vocab(n)
    evals = RetrievalCases("passkey", vocab, [128], DEPTHS, per_cell=2, seed=0, key_digits=(1, 1))
    assert train_keys[:10] != [evals[i].ids[-1] for i in range(10)]
