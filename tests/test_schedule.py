"""The learning-rate schedule and the optimizer through real train.py runs: the lr of every step
in metrics.jsonl against transformers' own schedule functions, and the parameters after ten steps
against transformers' model trained by hand with torch's AdamW on the groups a user expects.

Conventions. train.py's step s (0-based) of N with W warmup steps uses
    s < W:  lr (s + 1) / W           the first step already moves; the W-th reaches lr
    s >= W: the decay at frac = (s - W) / (N - 1 - W), which reaches the floor lr x min_lr_ratio
            AT the last step (s = N - 1).
transformers' lambdas give s / W in warmup (0 at the first step) and reach the floor AFTER the
last step, at num_training_steps. The curves coincide as ours(s) = theirs(s + 1) in warmup and
ours(s) = theirs(s) with num_training_steps = N - 1 after it; we compare exactly there.
"""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers.optimization as hf_opt
from dist_utils import run_train
from hf_ref import hf_model, save_hf
from test_train import CFG, metrics  # the tiny Qwen3 every train.py test uses

SEQ, LR, WD = 16, 1e-2, 0.5
# name: (decay, steps, warmup, min_lr_ratio)
RUNS = {
    "cosine": ("cosine", 10, 3, 0.1),
    "linear": ("linear", 8, 2, 0.25),
    "constant": ("constant", 6, 2, 0.1),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("schedule")
    save_hf(hf_model(CFG, seed=5), str(d / "model"))
    np.save(
        d / "tokens.npy",
        np.random.default_rng(2).integers(0, CFG.vocab_size, (10, SEQ + 1), dtype=np.int64),
    )
    done = {}

    def get(name):
        if name not in done:
            decay, steps, warmup, floor = RUNS[name]
            run_train(
                1,
                "--model",
                str(d / "model"),
                "--data",
                f"tokens:{d / 'tokens.npy'}",
                "--seq-len",
                str(SEQ),
                "--steps",
                str(steps),
                "--decay",
                decay,
                "--warmup-steps",
                str(warmup),
                "--min-lr-ratio",
                str(floor),
                "--lr",
                str(LR),
                "--weight-decay",
                str(WD),
                "--grad-clip",
                "1.0",
                "--adam-eps",
                "1e-4",  # far above the ~1e-9 rounding noise of a gradient (see replay)
                "--dtype",
                "float32",
                "--sp",
                "1",
                "--loss-chunk",
                "8",
                "--save-dtype",
                "float32",
                "--out",
                str(d / name),
            )
            done[name] = d / name
        return done[name]

    return d, get


def hf_lambdas(name):
    """transformers' schedule lambdas for the run `name`, as functions of their own step."""
    decay, steps, warmup, floor = RUNS[name]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    total = steps - 1  # see the module docstring
    make = {
        "cosine": [
            lambda: hf_opt.get_cosine_with_min_lr_schedule_with_warmup(
                opt, warmup, total, min_lr_rate=floor
            ),
            # min_lr 0 curve, mapped affinely onto the floor (decay part only)
            lambda: hf_opt.get_cosine_schedule_with_warmup(opt, warmup, total),
        ],
        "linear": [
            lambda: hf_opt.get_polynomial_decay_schedule_with_warmup(
                opt, warmup, total, lr_end=LR * floor, power=1.0
            ),
            lambda: hf_opt.get_linear_schedule_with_warmup(opt, warmup, total),
        ],
        "constant": [lambda: hf_opt.get_constant_schedule_with_warmup(opt, warmup)],
    }[decay]
    return [m().lr_lambdas[0] for m in make]


def expected_lr(name, s):
    """The lr of our step s by transformers: each of its curves that defines ours, all equal."""
    decay, steps, warmup, floor = RUNS[name]
    fns = hf_lambdas(name)
    if s < warmup:
        return [LR * f(s + 1) for f in fns]
    out = [LR * fns[0](s)]
    if len(fns) > 1:  # their min-0 curve c: ours = floor + (1 - floor) c
        out.append(LR * (floor + (1 - floor) * fns[1](s)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_lr_per_step_matches_transformers_schedules(runs, name):
    d, get = runs
    decay, steps, warmup, floor = RUNS[name]
    got = [r["lr"] for r in metrics(get(name))]
    print(name, [f"{x:.3e}" for x in got])
    assert len(got) == steps
    for s, lr in enumerate(got):
        for want in expected_lr(name, s):
            assert lr == pytest.approx(want, rel=1e-12, abs=1e-15), (name, s)
    # the shape by closed form too: warmup ends at lr, decays end at the floor on the last step
    assert got[warmup - 1] == pytest.approx(LR) and got[0] == pytest.approx(LR / warmup)
    assert got[-1] == pytest.approx(LR if decay == "constant" else LR * floor)
    assert all(a >= b for a, b in itertools.pairwise(got[warmup:]))  # never rises after warmup


def _decayed(name: str) -> bool:
    """Weight decay where a user expects it: every matrix (projections, embedding, lm_head); no
    norm weight (they are scales around 1: decaying them pulls activations toward 0)."""
    return not name.endswith("norm.weight")


def replay(d, name, decayed=_decayed):
    """transformers' model trained by hand on the same rows: the mean cross-entropy, the global
    gradient norm clipped to 1, torch's AdamW with weight decay on `decayed` parameters, at the
    lr transformers' schedule gives each step. Returns the parameters and the norms per step."""
    decay, steps, warmup, floor = RUNS[name]
    model = transformers_from(d / "model")
    named = dict(model.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if decayed(n)], "weight_decay": WD},
        {"params": [p for n, p in named.items() if not decayed(n)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-4)
    rows = torch.as_tensor(np.load(d / "tokens.npy"))
    norms = []
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = expected_lr(name, s)[0]
        opt.zero_grad()
        logits = model(rows[s : s + 1, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), rows[s : s + 1, 1:].flatten()).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
    return {n: p.detach() for n, p in named.items()}, norms


def transformers_from(path):
    import transformers

    return transformers.Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.slow
def test_adamw_with_weight_decay_on_matrices_matches_a_hand_replay(runs):
    """Ten steps of warmup + cosine with weight decay 0.5: train.py's final parameters equal
    transformers' model trained by hand with torch AdamW that decays matrices and embeddings and
    not norms, to 1e-3 of one step (lr) per step, as test_train allows one step (measured: 4.7e-6,
    in the embedding, against 1e-4); decaying every parameter (3.8e-2 on the norms) or none
    (1.9e-2 on the matrices) is more than 100x further.
    Adam's eps is 1e-4: its update lr g / (|g| + eps) would turn the 1e-9 rounding differences of
    near-zero gradients into full +-lr steps with eps 1e-8."""
    d, get = runs
    from safetensors.torch import load_file

    ours = load_file(str(get("cosine") / "final" / "model.safetensors"))
    want, norms = replay(d, "cosine")
    logged = [r["grad_norm"] for r in metrics(get("cosine"))]
    assert logged == pytest.approx(norms, rel=1e-4)

    def worst(ref, which=lambda n: True):
        return max((ours[n] - ref[n]).abs().max().item() for n in ref if which(n))

    err = worst(want)
    all_decayed, _ = replay(d, "cosine", decayed=lambda n: True)
    none_decayed, _ = replay(d, "cosine", decayed=lambda n: False)
    e_all, e_none = worst(all_decayed, lambda n: not _decayed(n)), worst(none_decayed, _decayed)
    print(
        f"max |ours - hand AdamW|: {err:.2e}; decaying norms too: {e_all:.2e} (norms); "
        f"decaying nothing: {e_none:.2e} (matrices)"
    )
    tol = len(norms) * 1e-3 * LR
    assert err <= tol
    assert e_all > 10 * tol and e_none > 10 * tol  # both wrong groupings would fail
