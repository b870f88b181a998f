"""Sequence parallelism across nodes: two torchrun agents on this machine act as two nodes of two
gloo processes each, and `--sp 4` spans both (every all-to-all crosses the "network").

    two_nodes(*train_py_flags)   # torchrun --nnodes 2 --node-rank R --nproc-per-node 2, R = 0, 1

  * the first step's loss and gradient norm, and the step-0 evaluation, equal transformers'
    (fp32, 1e-6 relative), with kv heads split (8 query, 4 kv: one kv head per rank) and with
    them repeated (4 query, 2 kv: sp > kv heads) while attention is kept (--save-attention);
  * a checkpoint the 2 x 2 run wrote after step 1 resumes on one node of 4 and on 2 x 2 again,
    with the losses of an uninterrupted run;
  * layouts that cannot work are refused in one line, exit 2, before any process group;
  * the dry run of 2 nodes of 8 at --sp 16 plans and projects, its all-to-alls over InfiniBand;
    the sweep's rows with sp over every node, the public 32-GPU run beside its projection.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from dist_utils import free_port, run_train
from hf_ref import hf_model, ref_loss_and_norm, save_hf

from bench.bench_attention import exchange_volumes
from memory.plan import GB, plan
from memory.steptime import INTERNODE_GBPS, NVLINK_GBPS, project
from memory.sweep import format_sweep, sweep
from model.config import PRESETS, Qwen3Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(
    vocab_size=211,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    head_dim=16,
    bos_token_id=None,
    eos_token_id=None,
)
MODELS = {
    "kv-split": Qwen3Config(**TINY, num_attention_heads=8, num_key_value_heads=4),  # 1 per rank
    "kv-repeat": Qwen3Config(**TINY, num_attention_heads=4, num_key_value_heads=2),  # each twice
    "kv-3": Qwen3Config(**TINY, num_attention_heads=12, num_key_value_heads=3),  # refused at sp 4
}
REL = 1e-6  # fp32: a few ulps of a loss ~5.4 and a gradient norm ~10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("nodes")
    refs = {}
    for name, cfg in MODELS.items():
        refs[name] = hf_model(cfg, seed=5)
        save_hf(refs[name], str(d / name))
    rng = np.random.default_rng(1)
    np.save(d / "tokens.npy", rng.integers(0, 211, size=(4, 65), dtype=np.int64))  # rows 64 + 1
    np.save(d / "eval.npy", rng.integers(0, 211, size=(1, 65), dtype=np.int64))
    return d, refs


def flags(d, model: str, out, steps: int = 1, sp: int = 4) -> list[str]:
    return [
        "--model",
        str(d / model),
        "--data",
        f"tokens:{d / 'tokens.npy'}",
        "--eval-data",
        f"tokens:{d / 'eval.npy'}",
        "--seq-len",
        "64",
        "--steps",
        str(steps),
        "--sp",
        str(sp),
        "--lr",
        "1e-2",
        "--warmup-steps",
        "0",
        "--dtype",
        "float32",
        "--adam-eps",
        "1e-6",  # rounding-noise gradients would move by +-lr with 1e-8 (tests/test_train.py)
        "--out",
        str(out),
        "--no-save-final",
        "--loss-chunk",
        "16",
    ]


def two_nodes(*argv: str, timeout: float = 150.0) -> str:
    """train.py FLAGS under two real torchrun agents, node ranks 0 and 1 of 2 processes each, one
    static rendezvous on a free port; returns both agents' output. Fails unless both exit 0.

    Two agents and four gloo workers on one machine meet over loopback; a run takes ~10 s. On a
    loaded 2-core machine a launch has been seen to hang instead (its logs were not kept), every
    process then waiting on gloo's 30-minute timeout. So a launch that outlives `timeout` is
    stopped with all its workers, its output printed, and tried once more on a new port; a second
    hang fails the test, as any error or nonzero exit does."""
    out = argv[argv.index("--out") + 1]
    for attempt in (1, 2):
        codes, text = _launch_two_nodes(argv, out, timeout)
        if codes is not None or attempt == 2:
            break
        print(f"two torchrun agents outlived {timeout:.0f} s; killed, trying a new port:")
        print(text[-3000:])
        shutil.rmtree(out, ignore_errors=True)  # the killed try's partial records and checkpoints
    assert codes == [0, 0], f"two torchrun agents exited {codes}:\n{text[-6000:]}"
    return text


def _launch_two_nodes(argv, out: str, timeout: float) -> tuple[list[int] | None, str]:
    """One launch of two_nodes: (exit codes, or None when it outlived timeout; both logs)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env["QWEN3_1M_CACHE"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), "qwen3-1m-tests")
    logs, procs = [], []
    for node in (0, 1):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        launcher += ["--node-rank", str(node), "--nproc-per-node", "2"]
        launcher += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        log = open(out + f".node{node}.log", "w+")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [*launcher, "train.py", *argv],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, for the last resort below
            )
        )
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:  # torchrun passes SIGTERM on to its workers, which lead their own groups
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = ""
    for log in logs:
        log.seek(0)
        text += log.read()
        log.close()
    return codes, text


def records(out) -> tuple[list[dict], list[dict]]:
    """(step records, evaluation records) of a run's metrics.jsonl."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if not r.get("eval")], [r for r in rows if r.get("eval")]


def check_against_transformers(d, ref, out) -> None:
    steps, evals = records(out)
    loss, norm, _ = ref_loss_and_norm(ref, np.load(d / "tokens.npy")[:1])
    eval_loss, _, _ = ref_loss_and_norm(ref, np.load(d / "eval.npy"))
    got = steps[0]
    first_eval = next(r for r in evals if r["step"] == 0)
    print(
        f"{out.name}: loss {got['loss']:.9f} (transformers {loss:.9f}), grad_norm "
        f"{got['grad_norm']:.9f} ({norm:.9f}), step-0 eval {first_eval['eval_loss']:.9f} "
        f"({eval_loss:.9f})"
    )
    assert got["loss"] == pytest.approx(loss, rel=REL)
    assert got["grad_norm"] == pytest.approx(norm, rel=REL)
    assert first_eval["eval_loss"] == pytest.approx(eval_loss, rel=REL)


@pytest.mark.slow
def test_sp4_across_two_nodes_matches_transformers(setup):
    """kv heads split over the 4 ranks of 2 nodes: transformers' first step and evaluation."""
    d, refs = setup
    out = d / "split"
    text = two_nodes(*flags(d, "kv-split", out))
    assert "4 cpu processes on 2 nodes of 2 (sp across 2 nodes): sp 4 x dp 1" in text
    check_against_transformers(d, refs["kv-split"], out)


@pytest.mark.slow
def test_kv_repeat_attention_once_and_resume_on_one_and_two_nodes(setup):
    """2 x 2, kv heads repeated, attention kept: transformers' first step; stopped after it, its
    checkpoint resumes on one node of 4 and on 2 x 2 with an uninterrupted run's losses."""
    d, refs = setup
    once = ["--save-attention", "--save-every", "1"]
    writer = d / "writer"
    two_nodes(*flags(d, "kv-repeat", writer, steps=3), *once, "--stop-after", "1")
    check_against_transformers(d, refs["kv-repeat"], writer)
    ckpt = writer / "checkpoints" / "step_000001"
    assert ckpt.is_dir()

    straight = d / "straight"
    run_train(4, *flags(d, "kv-repeat", straight, steps=3), *once)
    want = [r["loss"] for r in records(straight)[0]]
    assert records(writer)[0][0]["loss"] == want[0]  # the same step on 1 node and on 2

    on_one = d / "resumed-1node"
    p = run_train(4, *flags(d, "kv-repeat", on_one, steps=3), *once, "--resume", str(ckpt))
    assert f"resumed from {ckpt} at step 1" in p.stdout
    on_two = d / "resumed-2nodes"
    text = two_nodes(*flags(d, "kv-repeat", on_two, steps=3), *once, "--resume", str(ckpt))
    assert f"resumed from {ckpt} at step 1" in text
    for out in (on_one, on_two):
        got = [(r["step"], r["loss"]) for r in records(out)[0]]
        print(f"{out.name}: {got}; uninterrupted {list(enumerate(want, 1))[1:]}")
        assert [s for s, _ in got] == [2, 3]
        assert [loss for _, loss in got] == pytest.approx(want[1:], rel=REL)


@pytest.mark.parametrize(
    "world, per_node, sp, why",
    [
        (4, 2, 3, "--sp 3 does not divide the 4 processes"),
        (12, 4, 6, "--sp 6 spans nodes but is not a multiple of the 4 processes of a node"),
        (8, 4, 2, None),  # fits: the refusals below are about the layout, not the launch
        (16, 2, 8, "--sp 8: Ulysses sequence parallelism splits attention heads over sp ranks: "),
        (12, 4, 4, "--sp 4: 3 kv heads can neither be split over sp=4 nor repeated to it"),
    ],
)
def test_layouts_that_cannot_work_are_refused_in_one_line(
    setup, tmp_path, world, per_node, sp, why
):
    """A node's first process of such a launch (torchrun's variables) stops at the checks, exit 2,
    one line, before torch.distributed starts (--check-only proves the accepted one gets there)."""
    d, _ = setup
    model = "kv-3" if (world, sp) == (12, 4) else "kv-repeat"
    env = dict(RANK="0", LOCAL_RANK="0", GROUP_RANK="0")
    env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(per_node))
    argv = flags(d, model, tmp_path / "out", sp=sp)
    p = run_train(1, *argv, *(["--check-only"] if why is None else []), env=env, check=False)
    lines = p.stderr.strip().splitlines()
    print(world, per_node, sp, lines)
    if why is None:
        assert p.returncode == 0, p.stderr
        return
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: {why}")


def test_dry_run_plans_and_projects_sp16_over_two_nodes_of_8():
    """WORLD_SIZE=16 LOCAL_WORLD_SIZE=8 --sp 16: the plan and the projected step, with sp over
    both nodes; its all-to-alls are bench_attention's bytes, 8/15 of them (the 8 peers on the
    other node) over InfiniBand at its assumed rate, the other 7/15 beside them on NVLink."""
    env = dict(WORLD_SIZE="16", LOCAL_WORLD_SIZE="8")
    p = run_train(1, "--preset", "qwen3-8b-1m", "--sp", "16", "--dry-run", env=env)
    assert '"sp": 16' in p.stdout and '"dp": 1' in p.stdout
    assert "step, projected" in p.stdout and "InfiniBand 50" in p.stdout

    c = PRESETS["qwen3-8b"]
    t = project(plan(c, 2**20, gpus=16, sp=16, gpus_per_node=8, save_attention=True))
    a2a = sum(ph.terms.get("all-to-all", 0.0) for ph in t.phases)
    sent = exchange_volumes(c, 2**20, 16)["sent_per_step"]
    print(f"all-to-alls over 2 nodes: {a2a:.3f} s per step ({sent / GB:.1f} GB sent per GPU)")
    assert a2a == pytest.approx(sent * 8 / 15 / (INTERNODE_GBPS * GB), rel=1e-9)
    one_node = project(plan(c, 2**20, gpus=16, sp=16, gpus_per_node=16, save_attention=True))
    inside = sum(ph.terms.get("all-to-all", 0.0) for ph in one_node.phases)
    assert inside == pytest.approx(sent / (NVLINK_GBPS * GB), rel=1e-9)


def test_torchrun_sh_refuses_sp3_on_two_nodes_of_2_before_launching(tmp_path):
    """torchrun.sh's --check-only for node 0 of 2 nodes of 2: one line, exit 2, no torchrun."""
    env = {**os.environ, "NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "2"}
    argv = ["bash", "torchrun.sh", "--sp", "3", "--steps", "1", "--out", str(tmp_path / "out")]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    print(p.returncode, lines)
    assert p.returncode == 2
    assert lines[-1] == "error: --sp 3 does not divide the 4 processes: choose sp in [1, 2, 4]"
    assert "torch.distributed" not in p.stderr + p.stdout and not p.stdout


def test_sweep_rows_with_sp_over_every_node_beside_the_public_32_gpu_run():
    """The sweep's 16- and 32-GPU rows with sp over all nodes (dp 1) next to the dp rows; the
    32-GPU row at 4,194,304 tokens, attention recomputed, is the layout of the public run that
    measured 1346 s, and its projection is the one printed beside that measurement."""
    c = PRESETS["qwen3-8b"]
    p = plan(c, 2**20, gpus=8, sp=8, host_mem_gb=2000, tiled_mlp=True, mlp_tile=16384)
    rows = sweep(p)
    assert {(r.gpus, r.sp) for r in rows} == {(8, 8), (16, 8), (16, 16), (32, 8), (32, 32)}
    row = next(
        r for r in rows if (r.seq_len, r.gpus, r.sp, r.save_attention) == (2**22, 32, 32, False)
    )
    q = plan(c, 2**22, gpus=32, sp=32, gpus_per_node=8, options=row.plan.options)
    assert row.time.step_s == project(q).step_s and row.plan.fits
    text = format_sweep(p, rows)
    line = next(ln for ln in text.splitlines() if ln.split()[:3] == ["4,194,304", "32", "1"])
    print(line)
    assert line.split()[7] == f"{row.time.step_s:.0f}"
    public = f"4,194,304 tokens, 32 GPUs: measured 1346 s, projected {row.time.step_s:.0f} s"
    assert public in text


def test_check_nodes_joins_the_process_group_and_leaves(setup, tmp_path):
    """--check-nodes on 2 processes: the checks, one all-reduce over the group, rank 0's line,
    exit 0; nothing is loaded and --out is not taken (a run can start there next)."""
    d, _ = setup
    out = tmp_path / "out"
    argv = flags(d, "kv-repeat", out, sp=2)
    p = run_train(2, *argv, "--check-nodes")
    lines = [x for x in p.stdout.splitlines() if x.startswith("check-nodes:")]
    assert len(lines) == 1 and "2 processes on 1 node(s) reached each other" in lines[0], p.stdout
    assert "model ready" not in p.stdout and not (out / "metrics.jsonl").exists()
