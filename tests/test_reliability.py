"""Nothing lost, nothing late: refusals before any weight is read, a locked run directory, resume
after a damaged checkpoint, rotation, the disk-space refusal, preemption and non-finite steps.

Every run here is train.py in a subprocess, as a user starts it. "No weights read" is enforced, not
inferred: the model directory's model.safetensors is a FIFO, so any attempt to read it blocks and
the case times out instead of exiting 2.
"""

import functools
import json
import math
import os
import signal
import subprocess
import sys
import time

import dist_utils
import numpy as np
import pytest
import torch
from dist_utils import free_port

from model.config import ConfigError, Qwen3Config
from run.checkpoint import problem, rotate, trim_metrics
from run.rundir import RunLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = Qwen3Config(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    bos_token_id=None,
    eos_token_id=None,
)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def run(args, *, nproc=1, env=None, timeout=120, launcher="fork", setup=None):
    """train.py (or torchrun.sh) with args; returns the CompletedProcess.

    launcher "fork": train.py as __main__ on nproc ranks forked from dist_utils' fork server
    (torchrun's environment, no per-rank import of torch); "python": a plain `python train.py`;
    "torchrun.sh": the front door.
    """
    if launcher == "fork":  # forked from a process that has ENV's settings already
        return dist_utils.run_train(
            nproc, *args, env=env, timeout=timeout, check=False, setup=setup
        )
    env = {**ENV, **(env or {})}
    if launcher == "torchrun.sh":
        cmd = ["bash", "torchrun.sh", *args]
        env.update(NPROC_PER_NODE=str(nproc), MASTER_PORT=str(free_port()))
    else:
        cmd = [sys.executable, "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def ok(p):
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p


def metrics(out):
    """The step records (not the evaluations')."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if not r.get("eval")]


def tiny_run(out, *extra):
    """Flags of a small demo-model run (2 layers, 128 wide, 64-token vocabulary, 64-token rows)."""
    return ["--preset", "demo", "--seq-len", "64", "--save-every", "0", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rel")
    model = d / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CFG.to_hf()))
    os.mkfifo(model / "model.safetensors")  # reading it blocks: a case that reads weights hangs
    rng = np.random.default_rng(0)
    np.save(d / "tokens.npy", rng.integers(0, CFG.vocab_size, size=(4, 33), dtype=np.int64))
    bad = rng.integers(0, CFG.vocab_size, size=(4, 33), dtype=np.int64)
    bad[1, 5] = -1
    np.save(d / "negative.npy", bad)
    np.save(d / "floats.npy", np.zeros((4, 33), dtype=np.float32))
    for name, text in {
        "badjson": '{"vocab_size": 97,',
        "moe": json.dumps(
            {
                **CFG.to_hf(),
                "model_type": "qwen3_moe",
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": 8,
            }
        ),
    }.items():
        (d / name).mkdir()
        (d / name / "config.json").write_text(text)
        os.mkfifo(d / name / "model.safetensors")
    (d / "noweights").mkdir()
    (d / "noweights" / "config.json").write_text(json.dumps(CFG.to_hf()))
    (d / "a-file").write_text("not a directory")
    return d


# ---------------------------------------------------------------------------------------------
# Refusals: exit 2, one line naming the flag or file and the fix, no weights read
# ---------------------------------------------------------------------------------------------
def _cases(d):
    model = [
        "--model",
        str(d / "model"),
        "--data",
        f"tokens:{d / 'tokens.npy'}",
        "--seq-len",
        "32",
        "--steps",
        "2",
    ]
    return [  # (flags, words the one line must hold: the flag or file, and the way out)
        (model + ["--lr", "-1"], ["--lr", "positive finite"]),
        (model + ["--lr", "nan"], ["--lr nan", "positive finite"]),
        (model + ["--beta1", "2"], ["--beta1", "[0, 1)"]),
        (model + ["--grad-clip", "inf"], ["--grad-clip", "finite"]),
        (model + ["--tile-mlp", "-5"], ["--tile-mlp", "16384"]),
        (model + ["--yarn-factor", "-2"], ["--yarn-factor", ">= 1"]),
        (model + ["--max-bad-steps", "0"], ["--max-bad-steps", "positive"]),
        (model + ["--keep-checkpoints", "-1"], ["--keep-checkpoints", "keep all"]),
        (model + ["--save-dtype", "bf17"], ["--save-dtype", "bfloat16"]),
        (model + ["--decay", "cosin"], ["--decay", "cosine"]),
        (model + ["--lr", "abc"], ["--lr", "train.py -h"]),
        (model + ["--out", str(d / "a-file")], ["--out", "is a file", "directory"]),
        (model + ["--resume", str(d / "nowhere")], ["--resume", "--resume auto"]),
        (model + ["--sp", "3"], ["--sp 3", "divisor"]),
        (model + ["--loss-on", "predictable"], ["--loss-on predictable", "--loss-on all"]),
        (
            [
                "--model",
                str(d / "badjson"),
                "--data",
                f"tokens:{d / 'tokens.npy'}",
                "--seq-len",
                "32",
            ],
            [str(d / "badjson" / "config.json"), "not valid JSON", "restore"],
        ),
        (
            ["--model", str(d / "moe"), "--data", f"tokens:{d / 'tokens.npy'}", "--seq-len", "32"],
            [str(d / "moe" / "config.json"), "not a dense Qwen3", "Qwen/Qwen3-8B"],
        ),
        (
            ["--model", str(d / "noweights"), "--data", f"tokens:{d / 'tokens.npy'}"],
            ["--model", "no .safetensors"],
        ),
        (["--model", str(d / "nothere")], ["--model", "no such directory", "preset"]),
        (
            model[:2]
            + ["--data", f"tokens:{d / 'negative.npy'}", "--seq-len", "32", "--steps", "2"],
            ["negative.npy", "token id -1", "re-tokenise"],
        ),
        (
            model[:2] + ["--data", f"tokens:{d / 'floats.npy'}", "--seq-len", "32", "--steps", "2"],
            ["floats.npy", "not integer"],
        ),
        (
            model[:2] + ["--data", f"tokens:{d / 'tokens.npy'}", "--seq-len", "64", "--steps", "4"],
            ["tokens.npy", "shorter seq_len"],
        ),
        (["--model", "qwen3-0.6b", "--data", str(d)], ["--data", "tokenizer", "--data tokens:"]),
    ]


def test_bad_flags_and_files_exit_2_with_one_line_and_read_no_weights(files, tmp_path):
    for i, (flags, words) in enumerate(_cases(files)):
        argv = flags + ([] if "--out" in flags else ["--out", str(tmp_path / f"o{i}")])
        p = run(
            argv, timeout=60
        )  # a case that reads model.safetensors (a FIFO) hangs: TimeoutError
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert p.returncode == 2 and len(lines) == 1, (flags, p.returncode, p.stderr[-3000:])
        assert lines[0].startswith("error: ") and all(w in lines[0] for w in words), (
            flags,
            lines[0],
        )
        assert "model ready" not in p.stdout
        assert not os.path.exists(tmp_path / f"o{i}" / "metrics.jsonl")
    # and once as a plain process, for the exit code the shell sees
    p = run(_cases(files)[0][0] + ["--out", str(tmp_path / "o0")], launcher="python")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--lr" in p.stderr


@pytest.mark.slow
def test_torchrun_sh_checks_once_and_prints_one_line(files):
    """Through the launcher: the check runs in one process before torchrun starts N."""
    t0 = time.time()
    p = run(
        [
            "--model",
            str(files / "moe"),
            "--data",
            f"tokens:{files / 'tokens.npy'}",
            "--loss-on",
            "all",
        ],
        nproc=2,
        launcher="torchrun.sh",
    )
    errors = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode == 2 and len(errors) == 1 and "not a dense Qwen3" in errors[0], p.stderr[
        -3000:
    ]
    assert "torch.distributed" not in p.stderr and "Traceback" not in p.stderr
    print(f"refused through torchrun.sh in {time.time() - t0:.1f} s")


def test_config_refusals_are_config_errors_naming_the_file(files, tmp_path):
    with pytest.raises(ConfigError, match="not a dense Qwen3"):
        Qwen3Config.from_hf(str(files / "moe"))
    with pytest.raises(ConfigError, match=f"{files / 'badjson' / 'config.json'} is not valid JSON"):
        Qwen3Config.from_hf(str(files / "badjson"))
    (tmp_path / "config.json").write_text(json.dumps({**CFG.to_hf(), "num_key_value_heads": 3}))
    with pytest.raises(
        ConfigError, match=f"{tmp_path / 'config.json'}: num_attention_heads .* num_key_value_heads"
    ):
        Qwen3Config.from_hf(str(tmp_path))
    with pytest.raises(ConfigError, match="cannot read it as a Qwen3 config"):
        Qwen3Config.from_hf({**CFG.to_hf(), "hidden_size": "wide"})


@pytest.mark.parametrize(
    "model,extra",
    [
        ("qwen3-8b", []),  # the preset that crashed on --tile-mlp 0
        ("config-dir", ["--no-offload", "--yarn-factor", "4", "--sp", "2"]),
    ],
)
def test_dry_run_plans_any_model(model, extra, files):
    """A preset with default flags (--tile-mlp 0) and a directory of just config.json both plan."""
    name = str(files / "noweights") if model == "config-dir" else model
    p = run(["--model", name, "--dry-run", "--seq-len", "4096", *extra])
    assert p.returncode == 0, p.stderr[-2000:]
    want = CFG.hidden_size if model == "config-dir" else Qwen3Config.preset(model).hidden_size
    assert f'"hidden_size": {want},' in p.stdout and "peak memory per GPU" in p.stdout


# ---------------------------------------------------------------------------------------------
# The run directory: one run at a time, never mixed with an earlier one
# ---------------------------------------------------------------------------------------------
def test_locked_out_names_the_holder(tmp_path):
    out = tmp_path / "run"
    lock = RunLock(str(out)).acquire()  # this test process is "the other run"
    try:
        for flags in ([], ["--check-only"]):
            p = run(tiny_run(out, "--steps", "1", *flags))
            lines = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
            assert (
                f"in use by another run (pid {os.getpid()} on " in lines[0]
                and "another --out" in lines[0]
            )
    finally:
        lock.release()
    ok(run(tiny_run(out, "--steps", "1")))  # free again: it runs


@pytest.mark.slow
def test_rerun_is_refused_and_overwrite_moves_the_old_run_aside(tmp_path):
    out = tmp_path / "run"
    ok(run(tiny_run(out, "--steps", "3", "--save-every", "1")))
    before = (out / "metrics.jsonl").read_bytes()
    p = run(tiny_run(out, "--steps", "2"))
    assert p.returncode == 2 and "--resume auto" in p.stderr and "new --out" in p.stderr, p.stderr[
        -2000:
    ]
    assert (out / "metrics.jsonl").read_bytes() == before and len(metrics(out)) == 3
    assert sorted(os.listdir(out / "checkpoints")) == [
        "LATEST",
        "step_000002",
        "step_000003",
    ]  # keep 2

    ok(run(tiny_run(out, "--steps", "2", "--overwrite")))
    old = [n for n in os.listdir(tmp_path) if n.startswith("run.old-")]
    assert len(old) == 1 and (tmp_path / old[0] / "metrics.jsonl").read_bytes() == before
    assert [m["step"] for m in metrics(out)] == [1, 2]


# ---------------------------------------------------------------------------------------------
# Resume after anything
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_auto_skips_a_truncated_latest_and_leaves_no_duplicate(tmp_path):
    ok(run(tiny_run(tmp_path / "a", "--steps", "5")))
    straight = [m["loss"] for m in metrics(tmp_path / "a")]
    out = tmp_path / "b"
    ok(run(tiny_run(out, "--steps", "5", "--save-every", "1", "--stop-after", "3")))
    assert sorted(os.listdir(out / "checkpoints")) == ["LATEST", "step_000002", "step_000003"]
    shard = next(
        f for f in os.listdir(out / "checkpoints" / "step_000003") if f.endswith(".distcp")
    )
    with open(out / "checkpoints" / "step_000003" / shard, "r+b") as f:  # a copy cut short
        f.truncate(100)
    p = ok(run(tiny_run(out, "--steps", "5", "--resume", "auto")))
    assert f"skipped step_000003: {shard} is truncated (100 of" in p.stdout
    assert "resumed from" in p.stdout and "step_000002 at step 2" in p.stdout
    resumed = metrics(out)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in resumed] == straight


def disk_with_1_mb_free():
    """Setup for a train.py rank: the filesystem reports 1 MB free."""
    import run.checkpoint

    run.checkpoint.free_bytes = lambda path: 1_000_000


@pytest.mark.slow
def test_disk_shortfall_is_a_clear_error_and_the_last_checkpoint_stays(tmp_path):
    """Two processes: the error every rank raises reaches the user as rank 0's one line, first."""
    out = tmp_path / "run"
    args = tiny_run(out, "--steps", "4", "--save-every", "1", "--keep-checkpoints", "1")
    ok(run(args + ["--stop-after", "1"], nproc=2))
    p = run(args + ["--resume", "auto"], nproc=2, setup=disk_with_1_mb_free)
    errors = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode != 0 and errors, p.stderr[-3000:]
    assert errors[0].startswith("error: not enough disk for checkpoint step_000002"), errors
    assert "0.00 GB are free" in errors[0] and "step_000001) is intact" in errors[0]
    assert sorted(os.listdir(out / "checkpoints")) == ["LATEST", "step_000001"]
    assert problem(str(out / "checkpoints" / "step_000001")) is None


def test_trim_metrics_and_rotate(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 2, 3))
        + '{"step": 4, "lo'
    )
    assert trim_metrics(str(path), 2) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 2]
    root = tmp_path / "checkpoints"
    for n in ("step_000001", "step_000002", "step_000003", "step_000005", "step_000004.tmp"):
        (root / n).mkdir(parents=True)
    rotate(str(tmp_path), 3, keep=2)  # step 5 belongs to an abandoned later timeline: left for now
    assert sorted(os.listdir(root)) == ["step_000002", "step_000003", "step_000005"]


# ---------------------------------------------------------------------------------------------
# Preemption and non-finite steps
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_to_torchrun_sh_saves_and_resumes_to_the_same_losses(tmp_path):
    """SIGTERM to the front door mid-run: the step finishes, a checkpoint is written, exit 0; the
    resumed run's losses are the uninterrupted run's. Only the stopped run goes through torchrun.sh
    (the signal's path); the reference and the resume are the same train.py on forked ranks."""
    steps = ["--steps", "20"]
    ok(run(tiny_run(tmp_path / "a", *steps), nproc=2))
    straight = [m["loss"] for m in metrics(tmp_path / "a")]
    out = tmp_path / "b"
    env = {**ENV, "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen(
        ["bash", "torchrun.sh", *tiny_run(out, *steps)],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 240
    while not (
        os.path.exists(out / "metrics.jsonl")
        and len((out / "metrics.jsonl").read_text().splitlines()) >= 3
    ):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # as a scheduler does to the job's script
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "(SIGTERM received)" in stdout and "continue with --resume auto" in stdout, stdout[
        -2000:
    ]
    cut = len(metrics(out))
    assert 3 <= cut < 20 and os.path.isdir(out / "checkpoints" / f"step_{cut:06d}")
    ok(run(tiny_run(out, *steps, "--resume", "auto"), nproc=2))
    resumed = metrics(out)
    print(f"stopped after step {cut}; resumed to {len(resumed)}")
    assert [m["step"] for m in resumed] == list(range(1, 21)) and [
        m["loss"] for m in resumed
    ] == straight


@pytest.mark.slow
def test_sigusr1_to_a_single_process(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "train.py", *tiny_run(out, "--steps", "500")],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    while not os.path.exists(out / "metrics.jsonl") or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "(SIGUSR1 received)" in stdout, stderr[-3000:]
    assert os.path.isdir(out / "checkpoints" / f"step_{len(metrics(out)):06d}")


def _state(path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path + ".pt")
    return torch.load(path + ".pt", weights_only=False)


def _flat(x, prefix=""):
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix: x}


def nan_loss_at_steps(steps):
    """Setup for a train.py rank: the chunked loss is NaN at these 1-based steps (one loss call per
    step: no accumulation), because no tiny float32 model diverges on cue."""
    import loss.chunked_ce

    real, calls = loss.chunked_ce.chunked_cross_entropy, [0]

    def chunked_cross_entropy(*args, **kwargs):
        calls[0] += 1
        value = real(*args, **kwargs)
        return value * math.nan if calls[0] in steps else value

    loss.chunked_ce.chunked_cross_entropy = chunked_cross_entropy


@pytest.mark.slow
def test_nonfinite_steps_change_nothing_and_stop_the_run_after_max_bad_steps(tmp_path):
    """Steps 2-4 get a NaN loss (nan_loss_at_steps): the checkpoints after steps 2 and 4 hold
    exactly the weights and AdamW state of step 1, and the third bad step in a row stops the run."""
    out = tmp_path / "run"
    p = run(
        tiny_run(
            out, "--steps", "8", "--save-every", "1", "--keep-checkpoints", "0", "--lr", "1e-2"
        ),
        setup=functools.partial(nan_loss_at_steps, (2, 3, 4)),
    )
    line = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode == 3 and len(line) == 1, p.stderr[-3000:]
    assert "3 non-finite steps in a row (steps 2-4" in line[0] and "those after step 1" in line[0]
    assert "--resume auto" in line[0]
    m = metrics(out)
    assert [r["skipped"] for r in m] == [False, True, True, True] and [
        r["nonfinite_steps"] for r in m
    ] == [0, 1, 2, 3]
    assert (
        m[1]["loss"] is None and m[1]["grad_norm"] is None and np.isfinite(m[0]["loss"])
    )  # strict JSON: null
    ck = str(out / "checkpoints")
    one = _flat(_state(f"{ck}/step_000001"))
    assert any(
        k.startswith("optim.state.") for k in one
    )  # AdamW moments and step counts are in there
    for later in ("step_000002", "step_000004"):
        other = _flat(_state(f"{ck}/{later}"))
        assert one.keys() == other.keys()
        for k, v in one.items():
            assert torch.equal(v, other[k]) if isinstance(v, torch.Tensor) else v == other[k], (
                later,
                k,
            )
