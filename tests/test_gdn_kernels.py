"""model/gdn_kernels.py: the delta-rule kernel a run takes. A candidate with a wrong gradient (or
a wrong output) is passed over with the reason; of those that agree with the fp32 reference the
fastest is pinned; fla is refused in one line where it cannot run."""

import subprocess
import sys

import pytest
import torch

from model.delta_rule import gated_delta_rule
from model.gdn_kernels import PROBE_TOLERANCE, pick_gdn_kernel, probe

SHAPE = {"tokens": 300, "hk": 1, "hv": 2, "dk": 16, "dv": 16}
ROOT = __file__.rsplit("/tests/", 1)[0]


def scaled_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x's value, with its gradient multiplied by factor."""
    return x * factor - (x * (factor - 1)).detach()


def wrong_dg(q, k, v, g, beta, *, doc_lens=None):
    """Ours with the decay's gradient 10% too large: right output, a wrong dg."""
    return gated_delta_rule(q, k, v, scaled_gradient(g, 1.1), beta, doc_lens=doc_lens)


def wrong_decay(q, k, v, g, beta, *, doc_lens=None):
    """Ours with the log-decay taken per two tokens (a kernel reading g in another base or
    layout): a wrong output."""
    return gated_delta_rule(q, k, v, 2 * g, beta, doc_lens=doc_lens)


def textbook(q, k, v, g, beta, *, doc_lens=None):
    """Ours through the textbook chunk loop: right, another kernel to time."""
    return gated_delta_rule(q, k, v, g, beta, doc_lens=doc_lens, state_pass="loop")


def test_a_wrong_gradient_or_output_is_passed_over_and_the_right_ones_timed():
    rules = {"ours": gated_delta_rule, "wrong_dg": wrong_dg, "wrong_decay": wrong_decay}
    rules["textbook"] = textbook
    choice = pick_gdn_kernel("cpu", rules=rules, **SHAPE)
    print(choice.summary())
    assert choice.name in ("ours", "textbook") and set(choice.seconds) == {"ours", "textbook"}
    assert choice.seconds[choice.name] == min(choice.seconds.values())
    assert choice.passed_over["wrong_dg"].startswith("dg off by")
    assert choice.passed_over["wrong_decay"].startswith("output off by")
    assert "passed over wrong_dg: dg off by" in choice.summary()


def test_the_tolerance_sits_between_rounding_and_a_small_wrong_gradient():
    """bf16 inputs through ours against its fp32 run: well inside the tolerance; a 10% wrong
    gradient: well outside it (the margin that makes the probe's verdict safe)."""
    why, _ = probe(gated_delta_rule, gated_delta_rule, "cpu", **SHAPE)
    assert why is None
    why, _ = probe(wrong_dg, gated_delta_rule, "cpu", **SHAPE)
    error = float(why.split("off by ")[1].split()[0])
    assert error > 2 * PROBE_TOLERANCE, why


def test_requests_refused_in_one_line():
    with pytest.raises(ValueError, match="--gdn-kernel fla: Triton kernels run on CUDA only"):
        pick_gdn_kernel("cpu", request="fla", **SHAPE)
    with pytest.raises(ValueError, match="--gdn-kernel 'fast' is unknown"):
        pick_gdn_kernel("cpu", request="fast", **SHAPE)
    rules = {"ours": gated_delta_rule, "fla": wrong_dg}  # fla present, but wrong here
    with pytest.raises(ValueError, match="--gdn-kernel fla failed its probe .* dg off by"):
        pick_gdn_kernel("cpu", request="fla", rules=rules, **SHAPE)
    assert pick_gdn_kernel("cpu", request="ours", **SHAPE).name == "ours"
    only_ours = pick_gdn_kernel("cpu", **SHAPE)  # on a CPU nothing else can run: no probe
    assert only_ours.name == "ours" and not only_ours.seconds
    assert "CUDA only" in only_ours.passed_over["fla"]


def test_train_py_refuses_fla_when_not_installed():
    """Checked before any process group, one line, exit 2 (fla-core is not a test dependency)."""
    if "fla" in sys.modules or _importable("fla"):
        pytest.skip("fla-core is installed here")
    argv = [sys.executable, "train.py", "--model", "qwen3.5-tiny", "--data", "synthetic:copy"]
    argv += ["--seq-len", "64", "--steps", "1", "--gdn-kernel", "fla", "--dry-run"]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    print(p.stdout[-500:], p.stderr[-500:])
    assert p.returncode == 2
    assert "--gdn-kernel fla: fla-core is not installed (pip install -r requirements-fla.txt)" in (
        p.stderr + p.stdout
    )


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
