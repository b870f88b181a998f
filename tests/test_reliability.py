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
import pickle
import shutil
import signal
import subprocess
import sys
import time
import types

import dist_utils
import numpy as np
import pytest
import torch
from dist_utils import free_port

from model.config import ConfigError, Qwen3Config
from run.checkpoint import problem, rotate, trim_metrics
from run.checks import check_hub_source, hub_problem
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
    """Flags of a small demo-model run (2 layers, 128 wide, 64-token vocabulary, 64-token rows, one
    row a step: the demo's two would call the loss twice a step)."""
    return [
        "--preset", "demo", "--seq-len", "64", "--grad-accum", "1", "--save-every", "0",
        "--out", str(out), *extra,
    ]  # fmt: skip


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
        "llm": json.dumps(  # another architecture's config
            {**CFG.to_hf(), "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
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
        (model + ["--sp", "3"], ["--sp 3", "does not divide", "choose sp in"]),
        (model + ["--loss-on", "predictable"], ["--loss-on predictable", "--loss-on all"]),
        (
            model[:2] + ["--data", "synthetic:copy", "--seq-len", "1", "--steps", "2"],
            ["--seq-len 1", "synthetic:copy", "--seq-len 16"],
        ),
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
            ["--model", str(d / "llm"), "--data", f"tokens:{d / 'tokens.npy'}", "--seq-len", "32"],
            [str(d / "llm" / "config.json"), "is not a Qwen3", "Qwen/Qwen3-8B"],
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
            str(files / "llm"),
            "--data",
            f"tokens:{files / 'tokens.npy'}",
            "--loss-on",
            "all",
        ],
        nproc=2,
        launcher="torchrun.sh",
    )
    errors = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode == 2 and len(errors) == 1 and "is not a Qwen3" in errors[0], p.stderr[
        -3000:
    ]
    assert "torch.distributed" not in p.stderr and "Traceback" not in p.stderr
    print(f"refused through torchrun.sh in {time.time() - t0:.1f} s")


def test_config_refusals_are_config_errors_naming_the_file(files, tmp_path):
    with pytest.raises(ConfigError, match="is not a Qwen3"):
        Qwen3Config.from_hf(str(files / "llm"))
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
def dcp_load_fails_once():
    """Setup for a train.py rank: the first torch.distributed.checkpoint.load raises, as DCP does
    on every rank when a read fails after the checks passed."""
    import torch.distributed.checkpoint as dcp

    real, calls = dcp.load, [0]

    def load(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected: a shard read failed")
        return real(*args, **kwargs)

    dcp.load = load


@pytest.mark.slow
def test_resume_auto_skips_damaged_checkpoints_and_leaves_no_duplicate(tmp_path):
    """Four checkpoints, the newest three spoilt three ways: step 4's shard cut short, one byte
    of step 3's shard flipped (full length, so only the checksum sees it), step 2's DCP load
    failing. --resume auto names each with its reason, resumes from step 1, cuts metrics.jsonl
    back to it, and ends with exactly the straight run's losses."""
    ok(run(tiny_run(tmp_path / "a", "--steps", "5")))
    straight = [m["loss"] for m in metrics(tmp_path / "a")]
    out = tmp_path / "b"
    keep_all = ["--save-every", "1", "--keep-checkpoints", "0"]
    ok(run(tiny_run(out, "--steps", "5", *keep_all, "--stop-after", "4")))
    ck = out / "checkpoints"
    assert sorted(os.listdir(ck)) == ["LATEST"] + [f"step_00000{s}" for s in (1, 2, 3, 4)]
    shard = next(f for f in os.listdir(ck / "step_000004") if f.endswith(".distcp"))
    with open(ck / "step_000004" / shard, "r+b") as f:  # a copy cut short
        f.truncate(100)
    flipped = ck / "step_000003" / shard
    size = os.path.getsize(flipped)
    with open(flipped, "r+b") as f:  # one bit in the middle of the shard
        f.seek(size // 2)
        byte = f.read(1)[0]
        f.seek(size // 2)
        f.write(bytes([byte ^ 0x10]))
    assert os.path.getsize(flipped) == size and problem(str(ck / "step_000003")) is None
    p = ok(
        run(tiny_run(out, "--steps", "5", *keep_all, "--resume", "auto"), setup=dcp_load_fails_once)
    )
    assert f"skipped step_000004: {shard} is truncated (100 of" in p.stdout
    assert f"skipped step_000003: {shard} fails its checksum (crc32 " in p.stdout
    assert "skipped step_000002: it did not load (RuntimeError: injected" in p.stdout
    assert "resumed from" in p.stdout and "step_000001 at step 1" in p.stdout
    assert "cut back to step 1" in p.stdout
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


def rank_1_cannot_write_checkpoints():
    """Setup for a train.py rank: on rank 1, DCP's file writer fails as a full disk does (after
    the free-space check, which the disk passed). DCP gathers it into a CheckpointException that
    every rank raises."""
    if os.environ.get("RANK") != "1":
        return
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def write_data(self, plan, planner):
        raise OSError(28, "No space left on device")

    FileSystemWriter.write_data = write_data


@pytest.mark.slow
def test_a_failed_checkpoint_write_is_one_line_naming_the_rank(tmp_path):
    """DCP's CheckpointException is a BaseException, not an Exception: it still ends the run
    with exit 1 and rank 0's one line (after the traceback), naming the failing rank and its
    error."""
    args = tiny_run(tmp_path / "run", "--steps", "2", "--save-every", "1")
    p = run(args, nproc=2, setup=rank_1_cannot_write_checkpoints)
    errors = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode == 1 and errors, p.stderr[-3000:]
    want = "CheckpointException from rank 1: OSError: [Errno 28] No space left on device"
    assert errors[0] == f"error: {want}", errors
    assert p.stderr.index("Traceback") < p.stderr.index(errors[0])  # below the traceback


def dcp_save_raises_checkpoint_exception():
    """Setup for a train.py rank: torch.distributed.checkpoint.save raises what DCP raises when a
    rank's write fails: a CheckpointException (a BaseException) holding that rank's wrapped
    error, built as torch/distributed/checkpoint/utils.py builds it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def save(*args, **kwargs):
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise CheckpointException("write_data", {0: _wrap_exception(e)}) from None

    dcp.save = save


def test_a_checkpoint_exception_ends_the_run_with_its_one_line(tmp_path):
    """One process, the save failing inside DCP: exit 1 and one 'error: ...' line naming the rank
    and its error, not Python's bare traceback of an exception 'except Exception' lets by."""
    args = tiny_run(tmp_path / "run", "--steps", "1", "--save-every", "1", "--no-save-final")
    p = run(args, setup=dcp_save_raises_checkpoint_exception)
    errors = [x for x in p.stderr.splitlines() if x.startswith("error")]
    want = "error: CheckpointException from rank 0: OSError: [Errno 28] No space left on device"
    assert p.returncode == 1 and errors == [want], p.stderr[-3000:]


class Plant:
    """Unpickling it creates `path`: what a checkpoint from someone else could do on load."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _save_small_checkpoint(rank, world, out):
    """A checkpoint of a Linear and its AdamW after one step (in a group of one)."""
    from data import RowLoader
    from run.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    loader = RowLoader(np.zeros((4, 9), dtype=np.int64))
    next(loader)
    return save_checkpoint(out, 1, model, opt, loader, rank)


def _replace(ckpt, name, obj):
    """Put `obj`'s pickle at ckpt/name and rewrite the manifest to match, as a forger would."""
    from run.manifest import MANIFEST, file_record, write_manifest

    if name.endswith(".pt"):
        torch.save(obj, os.path.join(ckpt, name))
    else:
        with open(os.path.join(ckpt, name), "wb") as f:
            pickle.dump(obj, f)
    names = [n for n in os.listdir(ckpt) if n != MANIFEST]
    write_manifest(ckpt, {n: file_record(os.path.join(ckpt, n)) for n in names})


def test_checkpoint_files_that_would_run_code_are_refused_by_name(tmp_path):
    """A forged checkpoint (manifest rewritten to match): its RNG file, its DCP .metadata and a
    DCP item each pickle a call to open(MARKER, "w"). Each is refused naming the file, and the
    marker never appears: nothing was run. Through train.py --resume too: one line, exit 2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from run.checkpoint import verify
    from run.safe_load import SafeLoadPlanner

    marker = tmp_path / "MARKER"
    (good,) = dist_utils.run_distributed(_save_small_checkpoint, 1, str(tmp_path / "run"))
    assert problem(good) is None and verify(good) is None
    rng = str(tmp_path / "rng")
    shutil.copytree(good, rng)
    _replace(rng, "rng_rank00000.pt", {"cpu": Plant(marker)})
    assert problem(rng) is None  # sizes and manifest agree: only reading it would tell
    why = verify(rng)
    assert (
        why.startswith("rng_rank00000.pt holds more than plain tensors") and "weights_only" in why
    )
    meta = str(tmp_path / "meta")
    shutil.copytree(good, meta)
    _replace(meta, ".metadata", Plant(marker))
    why = problem(meta)
    assert why.startswith("its .metadata does not read") and "it refers to io.open" in why, why
    dcp.save({"x": Plant(marker)}, checkpoint_id=str(tmp_path / "item"))
    with pytest.raises(CheckpointException) as refused:
        dcp.load({"x": None}, checkpoint_id=str(tmp_path / "item"), planner=SafeLoadPlanner())
    first, _ = refused.value.failures[0]  # DCP gathers each rank's (exception, traceback)
    assert str(first).startswith("its item x holds more than plain tensors (it refers to io.open)")
    assert not marker.exists()

    p = run(tiny_run(tmp_path / "o", "--resume", rng))
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"error: --resume {rng}: not a loadable checkpoint (rng_rank00000")
    assert not marker.exists()


def _no_answer(self, repo_id, **kwargs):
    raise ConnectionError(f"cannot reach huggingface.co for {repo_id}")


def hub_unreachable():
    """Setup for a train.py rank: the hub's metadata request fails, as it does offline."""
    import huggingface_hub

    huggingface_hub.HfApi.dataset_info = _no_answer


def test_pg19_without_network_is_one_line_before_any_weight(files, tmp_path, monkeypatch):
    """No network (injected: the hub's metadata request fails) and no token cache: one line
    with the offline recipe, at once, before the model's weights (a FIFO) are touched. A
    cache entry for the rows is enough to go on without the hub."""
    import huggingface_hub

    cache = tmp_path / "cache"
    flags = ["--model", str(files / "model"), "--data", "pg19", "--seq-len", "32"]
    t0 = time.time()
    p = run(
        flags + ["--cache-dir", str(cache), "--out", str(tmp_path / "o")], setup=hub_unreachable
    )
    seconds = time.time() - t0
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    for words in (
        "error: --data pg19: the Hugging Face hub does not answer (ConnectionError: cannot reach",
        "huggingface-cli download emozilla/pg19 --repo-type dataset",
        "--data 'DIR/data/train-*.parquet'",
    ):
        assert words in lines[0], lines[0]
    assert "model ready" not in p.stdout and seconds < 30, seconds

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", _no_answer)
    hub_problem.cache_clear()  # this process's answers so far (asked once per process)
    cfg = types.SimpleNamespace(data="pg19", seq_len=32, seed=0, cache_dir=str(cache))
    with pytest.raises(ConfigError, match="does not answer"):
        check_hub_source(cfg)
    cache.mkdir()
    (cache / "pg19-L32-seed0-0123456789abcdef.npy").write_bytes(b"")
    check_hub_source(cfg)  # a cache entry of these rows: no hub needed


def test_the_hub_is_asked_once_per_process(tmp_path, monkeypatch):
    """train.py checks the data before its process group starts and again inside it, and a pg19
    run holds out pg19:validation, the same dataset: one request per dataset and process, and
    a hub that does not answer is refused every time."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(
        huggingface_hub.HfApi, "dataset_info", lambda self, repo_id, **kw: asked.append(repo_id)
    )
    hub_problem.cache_clear()
    for data in ("pg19", "pg19", "pg19:validation", "hf:someone/books", "hf:someone/books"):
        check_hub_source(
            types.SimpleNamespace(data=data, seq_len=32, seed=0, cache_dir=str(tmp_path))
        )
    assert asked == ["emozilla/pg19", "someone/books"]
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", _no_answer)
    offline = types.SimpleNamespace(
        data="hf:someone/else", seq_len=32, seed=0, cache_dir=str(tmp_path)
    )
    for _ in range(2):
        with pytest.raises(ConfigError, match="does not answer"):
            check_hub_source(offline)
    hub_problem.cache_clear()


def export_dies_half_way():
    """Setup for a train.py rank: writing the final safetensors fails half-way (a full disk the
    check could not foresee, a node going down)."""
    import model.weights

    def save_file(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(28, "No space left on device")

    model.weights.save_file = save_file


@pytest.mark.slow
def test_final_export_is_disk_checked_and_never_half_written(tmp_path):
    """The final model is checked for room first (exit 3, nothing written, the line says what is
    left to resume from), and a write that dies half-way leaves no OUT/final."""
    out = tmp_path / "short"
    p = run(tiny_run(out, "--steps", "1"), setup=disk_with_1_mb_free)
    errors = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode == 3 and len(errors) == 1, p.stderr[-3000:]
    assert errors[0].startswith("error: not enough disk for the final model under ")
    assert "nothing was written and no checkpoint was written (--save-every 0)" in errors[0]
    assert not os.path.exists(out / "final") and not os.path.exists(out / "final.tmp")
    out = tmp_path / "dies"
    p = run(tiny_run(out, "--steps", "1"), setup=export_dies_half_way)
    assert p.returncode == 1 and "No space left on device" in p.stderr, p.stderr[-3000:]
    assert not os.path.exists(out / "final")
    assert os.listdir(out / "final.tmp")  # the half-written files are there, under .tmp


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
