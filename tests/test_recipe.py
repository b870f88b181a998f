"""The recipe's own settings through train.py, as a user runs it, against transformers in fp32:
bf16 end to end, YaRN, tied embeddings under Ulysses, and resume under dp x sp in bf16.

Every run here is several steps with a non-zero learning rate and weight decay, on a cosine
schedule with --min-lr-ratio 0 (and a warmup step when there are more than 2): the LAST step's
rate is then exactly 0 (AdamW with lr 0 leaves every parameter bit for bit unchanged, weight
decay included), so the saved final parameters are the ones that step's loss and gradient norm
were computed at. That lets a reference load them and check the last step exactly like the
first, after real updates.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from dist_utils import run_train
from hf_ref import hf_config, hf_model, ref_loss_and_norm, save_hf
from safetensors.torch import load_file
from test_train import CFG, metrics  # the tiny Qwen3 every train.py test uses

from model.config import Qwen3Config

TIED = dataclasses.replace(CFG, tie_word_embeddings=True)
YARN = (4.0, 16)  # factor, original_max_position_embeddings: rows of 64 reach position 63 > 16
SEQ, ROWS = 64, 8
U = 2.0**-8  # bf16 machine epsilon; one rounding is at most u/2 relative


def _args(d, model, *, steps, dtype="float32"):
    return [
        "--model",
        str(d / model),
        "--data",
        f"tokens:{d / 'tokens.npy'}",
        "--seq-len",
        str(SEQ),
        "--steps",
        str(steps),
        "--lr",
        "1e-2",
        "--weight-decay",
        "0.1",
        "--warmup-steps",
        str(int(steps > 2)),
        "--decay",
        "cosine",
        "--min-lr-ratio",
        "0",
        "--grad-clip",
        "1.0",
        "--dtype",
        dtype,
        "--adam-eps",
        "1e-6",  # see test_train: rounding-noise gradients must not move a full lr
        "--save-dtype",
        "float32",
        "--loss-chunk",
        "16",
    ]


# Every layout: (processes, flags, rows per step). bf16 runs take the whole bf16 path: FSDP2
# param_dtype bf16 with fp32 reduction, offload of every layer input, tiled MLP, chunked loss.
BF16_EXTRA = ["--offload", "--offload-min-bytes", "0", "--tile-mlp", "16"]
LAYOUTS = {
    "1proc": (1, ["--sp", "1"], 1),
    "sp2": (2, ["--sp", "2"], 1),
    "dp2xsp2": (4, ["--sp", "2"], 2),
}


class Runs:
    """Runs on demand, each once per module (pytest -k picks only what it needs)."""

    def __init__(self, d):
        self.d, self.done = d, {}

    def get(self, name, nproc, *args):
        if name not in self.done:
            out = self.d / name
            run_train(nproc, *args, "--out", str(out))
            self.done[name] = out
        return self.done[name]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("recipe")
    save_hf(hf_model(CFG, seed=3), str(d / "model"))
    save_hf(hf_model(TIED, seed=4), str(d / "tied"))
    rng = np.random.default_rng(1)
    np.save(d / "tokens.npy", rng.integers(0, CFG.vocab_size, size=(ROWS, SEQ + 1), dtype=np.int64))
    return d, Runs(d)


# ---------------------------------------------------------------------------------------------
# The reference: transformers' Qwen3ForCausalLM in fp32 at given parameters
# ---------------------------------------------------------------------------------------------
def reference(cfg: Qwen3Config, weights: dict):
    """transformers in fp32, built from cfg (YaRN and tying as cfg says), holding `weights`."""
    import transformers

    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(hf_config(cfg)).float().eval()
    missing, unexpected = m.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= (
        {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    )
    if cfg.tie_word_embeddings:
        assert m.lm_head.weight is m.model.embed_tokens.weight
    return m


def initial(d, model):
    return {
        k: v
        for f in sorted(os.listdir(d / model))
        if f.endswith(".safetensors")
        for k, v in load_file(str(d / model / f)).items()
    }


def final(out):
    return load_file(str(out / "final" / "model.safetensors"))


loss_and_norm = ref_loss_and_norm  # (loss, grad norm, logits rms) of transformers on the rows


def step_rows(d, step: int, per_step: int) -> np.ndarray:
    """The rows step `step` (1-based) reads: dp rank r takes the next row after rank r-1."""
    rows = np.load(d / "tokens.npy")
    return rows[(step - 1) * per_step : step * per_step]


# ---------------------------------------------------------------------------------------------
# bf16 end to end
# ---------------------------------------------------------------------------------------------
# Where a bf16 run can differ from fp32 at the same parameters, and by how much.
#  * Forward: every GEMM reads bf16 operands and rounds its output to bf16, as do the norms,
#    RoPE, attention, SwiGLU and each residual add: per layer about K = 14 roundings on the path
#    from the embedding to the next layer, 2 layers, plus the final norm and the logits (on CPU the
#    logits are rounded to bf16 before the fp32 log-softmax): K_f = 2 x 14 + 2 = 30 roundings, each
#    a relative error uniform in +-u/2 (standard deviation u/(2 sqrt 3)). Independent roundings add
#    like a random walk: a logit's error has standard deviation s_z <= sqrt(K_f / 3) u/2 z_rms.
#  * Loss: a token's loss logsumexp(z) - z_t moves by (p - onehot(t)) . dz, whose standard
#    deviation is at most |p - onehot|_2 s_z <= sqrt(2) s_z; the step's loss is the mean over N
#    tokens (64, or 128 with dp=2) with independent rounding, so s_L <= sqrt(2 / N) s_z, and we
#    allow 5 s_L. (Measured errors sit near the last rounding alone, 10-30x inside this; a
#    log-softmax rounded to bf16, u/2 of |log p| ~ 5.4 per token, lands outside it at step 1.)
#  * Gradient norm: backward rounds as often again (K_b ~ K_f), and the weight gradients sum over
#    the tokens in fp32 (the chunked loss and FSDP2's reduce-scatter accumulate in fp32), so no
#    growth with N: norm-wise |g~ - g| <= sqrt(K_f + K_b) u/2 |g| as a worst case, and the norm
#    itself moves by at most |g~ - g|: relative error <= sqrt(60) u/2 = 1.5e-2.
#  * Later steps: by the lr-0 last step (see the module docstring) the reference holds the bf16
#    run's own fp32 master weights, so the same bounds hold at step 4 as at step 1.
K_F = 2 * 14 + 2


def bf16_loss_tol(z_rms: float, n_tokens: int) -> float:
    s_z = (K_F / 3) ** 0.5 * U / 2 * z_rms
    return 5 * (2 / n_tokens) ** 0.5 * s_z


BF16_NORM_RTOL = (2 * K_F) ** 0.5 * U / 2


def _bf16(env, layout):
    d, runs = env
    n, flags, per = LAYOUTS[layout]
    save = ["--save-every", "2"] if layout == "dp2xsp2" else []  # the resume test starts from it
    out = runs.get(
        f"bf16-{layout}",
        n,
        *_args(d, "model", steps=4, dtype="bfloat16"),
        *flags,
        *BF16_EXTRA,
        *save,
    )
    return out, per


def _fp32(env, per):
    d, runs = env
    accum = ["--grad-accum", str(per)]
    return runs.get(f"fp32-accum{per}", 1, *_args(d, "model", steps=4), "--sp", "1", *accum)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_matches_fp32_and_transformers(env, layout):
    d, _ = env
    out, per = _bf16(env, layout)
    fp32 = _fp32(env, per)
    m, m32 = metrics(out), metrics(fp32)
    assert [r["step"] for r in m] == [1, 2, 3, 4] and m[-1]["lr"] == 0.0 and m[1]["lr"] > 0
    start = reference(CFG, initial(d, "model"))
    checks = [(1, start, m32[0]), (4, reference(CFG, final(out)), None)]
    for step, ref, ours32 in checks:
        rows = step_rows(d, step, per)
        loss, norm, z_rms = loss_and_norm(ref, rows)
        tol = bf16_loss_tol(z_rms, rows.shape[0] * SEQ)
        got = m[step - 1]
        print(
            f"bf16 {layout} step {step}: loss {got['loss']:.6f} vs transformers fp32 {loss:.6f} "
            f"(|d| {abs(got['loss'] - loss):.2e}, tol {tol:.2e}); "
            f"grad_norm {got['grad_norm']:.6f} vs {norm:.6f} "
            f"(rel {abs(got['grad_norm'] / norm - 1):.2e}, tol {BF16_NORM_RTOL:.2e})"
        )
        assert abs(got["loss"] - loss) <= tol
        assert got["grad_norm"] == pytest.approx(norm, rel=BF16_NORM_RTOL)
        if ours32 is not None:  # the fp32 run of the same rows: transformers to fp32 rounding
            assert ours32["loss"] == pytest.approx(loss, rel=1e-5)
            assert ours32["grad_norm"] == pytest.approx(norm, rel=1e-4)
            assert abs(got["loss"] - ours32["loss"]) <= tol
            assert got["grad_norm"] == pytest.approx(ours32["grad_norm"], rel=BF16_NORM_RTOL)
            # ...and bf16 really ran: an ignored --dtype would give the fp32 numbers exactly
            assert got["loss"] != ours32["loss"] and got["grad_norm"] != ours32["grad_norm"]


@pytest.mark.slow
@pytest.mark.parametrize("per", [1, 2])
def test_fp32_several_steps_match_transformers(env, per):
    """The fp32 runs the bf16 ones are held against, at their last step too (after three updates
    with weight decay): transformers at the run's own final parameters, to fp32 rounding."""
    d, _ = env
    out = _fp32(env, per)
    m = metrics(out)
    loss, norm, _ = loss_and_norm(reference(CFG, final(out)), step_rows(d, 4, per))
    print(
        f"fp32 accum {per} step 4: loss {m[3]['loss']:.7f} vs {loss:.7f}, "
        f"grad_norm {m[3]['grad_norm']:.6f} vs {norm:.6f}"
    )
    assert m[3]["loss"] == pytest.approx(loss, rel=1e-5) and m[3]["grad_norm"] == pytest.approx(
        norm, rel=1e-4
    )


# ---------------------------------------------------------------------------------------------
# Resume under dp=2 x sp=2, in bf16
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_dp2_sp2_bf16_is_bit_exact(env):
    """2 + 2 steps leave exactly the parameters of 4 straight steps. The straight run saved a
    checkpoint at step 2 on its way (saving changes nothing); a second launch resumes from it into a
    fresh directory and runs steps 3 and 4. Exact, not to rounding: the checkpoint holds the fp32
    master weights and both AdamW moments bit for bit (DCP writes the shards as they are), the
    loader restarts at the same row, and the steps after the resume run the same operations in
    the same order on the same ranks; bf16 casts are deterministic."""
    d, runs = env
    straight, _ = _bf16(env, "dp2xsp2")
    ckpt = straight / "checkpoints" / "step_000002"
    assert os.path.isdir(ckpt)
    n, flags, _ = LAYOUTS["dp2xsp2"]
    p = run_train(
        n,
        *_args(d, "model", steps=4, dtype="bfloat16"),
        *flags,
        *BF16_EXTRA,
        "--out",
        str(d / "bf16-resumed"),
        "--resume",
        str(ckpt),
    )
    assert "resumed from" in p.stdout
    a, b = final(straight), final(d / "bf16-resumed")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"resumed vs straight: max |parameter difference| {worst:.1e}")
    assert all(torch.equal(a[k], b[k]) for k in a)
    resumed = metrics(d / "bf16-resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in metrics(straight)[2:]]


def dcp_state(path, to) -> dict:
    """A DCP checkpoint as full tensors: {"model": {name: tensor}, "optim": {"state": ...}}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(to))
    return torch.load(str(to), weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sp2", "1proc"])
def test_resume_on_another_layout_continues_the_rows(env, layout):
    """The dp 2 x sp 2 run's step-2 checkpoint (4 processes, bf16) resumed on sp 2 (2 processes)
    and on 1 process, in fp32, for step 3, which is the cosine schedule's lr-0 last step of a
    3-step run (see the module docstring), so the final export holds the parameters as loaded:
      * they equal the checkpoint's model state exactly (DCP resharded 4 shards into 2 or 1);
      * step 3 reads row 4: the 4 rows the writer consumed (2 steps x dp 2) are passed, and a
        dp-1 run continuing from there reads row 4 next. Its loss is transformers' at those
        parameters on row 4 to fp32 rounding (loss 1e-5, gradient norm 1e-4), and every other
        row misses one of the two by 10x;
      * AdamW's state came along (its step count reads 3 after one more step, not 1), and the
        new checkpoint records 5 rows consumed and the layout that wrote it."""
    d, _ = env
    writer, _ = _bf16(env, "dp2xsp2")
    ckpt = writer / "checkpoints" / "step_000002"
    n, flags, _ = LAYOUTS[layout]
    out = d / f"resumed-{layout}"
    p = run_train(
        n,
        *_args(d, "model", steps=3),
        *flags,
        "--save-every",
        "3",
        "--out",
        str(out),
        "--resume",
        str(ckpt),
    )
    now = "2 processes (sp 2)" if n == 2 else "1 process"
    assert f"resume: written by 4 processes (dp 2 x sp 2), loading on {now}: " in p.stdout
    assert "data from row 4" in p.stdout and f"resumed from {ckpt} at step 2" in p.stdout
    saved = dcp_state(ckpt, d / f"ckpt2-{layout}.pt")
    got = final(out)
    assert set(got) == set(saved["model"]) and got
    assert all(torch.equal(got[k], saved["model"][k]) for k in got)

    m = metrics(out)
    assert [r["step"] for r in m] == [3] and m[0]["lr"] == 0.0
    ref = reference(CFG, got)
    rows = np.load(d / "tokens.npy")
    losses = [loss_and_norm(ref, rows[r : r + 1])[:2] for r in range(ROWS)]
    print(f"{layout}: step 3 loss {m[0]['loss']:.7f}; transformers per row", losses)
    assert m[0]["loss"] == pytest.approx(losses[4][0], rel=1e-5)
    assert m[0]["grad_norm"] == pytest.approx(losses[4][1], rel=1e-4)
    for r, (loss, norm) in enumerate(losses):  # any other row misses one of them by 10x
        far = abs(loss / m[0]["loss"] - 1) > 1e-4 or abs(norm / m[0]["grad_norm"] - 1) > 1e-3
        assert far or r == 4, r

    after = out / "checkpoints" / "step_000003"
    with open(after / "train_state.json") as f:
        state = json.load(f)
    assert state["data"] == {"next_row": 5} and state["step"] == 3
    assert (state["world"], state["sp"], state["dp"]) == (n, n, 1)
    optim = dcp_state(after, d / f"ckpt3-{layout}.pt")["optim"]["state"]
    assert set(optim) == set(got) and {float(v["step"]) for v in optim.values()} == {3.0}


# ---------------------------------------------------------------------------------------------
# YaRN through train.py
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2])
def test_yarn_flags_match_transformers_yarn(env, sp):
    """--yarn-factor 4 --yarn-original 16 on a checkpoint without rope scaling, rows of 64
    (positions up to 63, four times past the original 16; fp32 angles at positions < 64 are
    within 64 x 2^-24 rad of fp64, far below the tolerance), against transformers' Qwen3 built
    with the same YaRN scaling. Without YaRN the first loss would differ by 70x the tolerance."""
    d, runs = env
    factor, orig = YARN
    out = runs.get(
        f"yarn-sp{sp}",
        sp,
        *_args(d, "model", steps=2),
        "--sp",
        str(sp),
        "--yarn-factor",
        str(factor),
        "--yarn-original",
        str(orig),
    )
    m = metrics(out)
    assert m[-1]["lr"] == 0.0
    ycfg = CFG.with_yarn(factor, orig)
    ref0 = reference(ycfg, initial(d, "model"))
    assert (
        ref0.config.rope_parameters["rope_type"] == "yarn"
        and ref0.config.rope_parameters["factor"] == factor
    )
    for step, ref in ((1, ref0), (2, reference(ycfg, final(out)))):
        loss, norm, _ = loss_and_norm(ref, step_rows(d, step, 1))
        print(
            f"yarn sp{sp} step {step}: loss {m[step - 1]['loss']:.7f} vs {loss:.7f}, "
            f"grad_norm {m[step - 1]['grad_norm']:.6f} vs {norm:.6f}"
        )
        assert m[step - 1]["loss"] == pytest.approx(loss, rel=1e-5)
        assert m[step - 1]["grad_norm"] == pytest.approx(norm, rel=1e-4)
    plain, _, _ = loss_and_norm(reference(CFG, initial(d, "model")), step_rows(d, 1, 1))
    print(f"without YaRN the first loss would be {plain:.7f}")
    assert abs(plain - m[0]["loss"]) > 10 * 1e-5 * abs(plain)  # the test can tell YaRN from none


# ---------------------------------------------------------------------------------------------
# Tied embeddings under Ulysses
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sp2", "dp2xsp2"])
def test_tied_embeddings_match_transformers(env, layout):
    """A tied checkpoint: the loss reads the embedding's Parameter, owned by the root FSDP2 unit
    and gathered for the whole step. Two steps (the second at lr 0), both against transformers."""
    d, runs = env
    n, flags, per = LAYOUTS[layout]
    out = runs.get(f"tied-{layout}", n, *_args(d, "tied", steps=2), *flags)
    m = metrics(out)
    saved = final(out)
    assert "lm_head.weight" not in saved  # tied checkpoints omit it, as transformers does
    for step, ref in ((1, reference(TIED, initial(d, "tied"))), (2, reference(TIED, saved))):
        loss, norm, _ = loss_and_norm(ref, step_rows(d, step, per))
        print(
            f"tied {layout} step {step}: loss {m[step - 1]['loss']:.7f} vs {loss:.7f}, "
            f"grad_norm {m[step - 1]['grad_norm']:.6f} vs {norm:.6f}"
        )
        assert m[step - 1]["loss"] == pytest.approx(loss, rel=1e-5)
        assert m[step - 1]["grad_norm"] == pytest.approx(norm, rel=1e-4)
