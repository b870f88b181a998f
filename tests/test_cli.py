"""What a user sees of train.py: -h, step lines, the closing summary, OUT/config.json, --report-to.

One short demo run (1 process, 6 steps, a checkpoint every 2, TensorBoard on) serves most checks;
one more run from its OUT/config.json checks that the file is the same run. The reference for every
printed number is the run's own metrics.jsonl, and for the event file TensorBoard's reader.
"""

import dataclasses
import json
import os
import re

import pytest
from dist_utils import run_train
from test_train import eval_records
from test_train import metrics as _metrics

import train

STEPS, EVERY = 6, 2


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    tb = ["--report-to", "tensorboard"] if _has("tensorboard") else []
    out = tmp / "demo"
    p = run_train(
        1,
        "--preset",
        "demo",
        "--steps",
        str(STEPS),
        "--sp",
        "1",
        "--save-every",
        str(EVERY),
        "--keep-checkpoints",
        "2",
        "--out",
        str(out),
        *tb,
    )
    return tmp, out, p


def _has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


# ---------------------------------------------------------------------------------------------
# -h
# ---------------------------------------------------------------------------------------------
def test_help_documents_every_flag_default_choices_and_presets():
    p = run_train(1, "-h", env={"COLUMNS": "200"})
    text = p.stdout
    # argparse's layout: each flag's help is the text from its option line to the next option line
    blocks = dict(
        re.findall(r"^  (--[\w-]+)[^\n]*?(?:  +|\n\s+)(.*?)(?=^  -|\Z)", text, re.S | re.M)
    )
    for f in dataclasses.fields(train.TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert f.metadata.get("help"), f"{flag} has no help: declare it with arg(default, help)"
        assert flag in blocks, f"{flag} is not in -h"
        body = " ".join(blocks[flag].split())
        assert body.startswith(" ".join(f.metadata["help"].split())), (flag, body)
        shown = "unset" if f.default is None else repr(f.default)
        assert f"(default: {shown}" in body, (flag, body)
        for choice in f.metadata.get("choices") or ():
            assert choice in body, (flag, choice, body)
    for name, (line, _) in train.PRESETS.items():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(line)}$", text, re.M), name
    assert "--config" in blocks and "--preset" in blocks


# ---------------------------------------------------------------------------------------------
# The demo's output
# ---------------------------------------------------------------------------------------------
def test_demo_says_what_it_does_and_what_happened(demo):
    tmp, out, p = demo
    lines = p.stdout.splitlines()
    m = _metrics(out)
    assert [r["step"] for r in m] == list(range(1, STEPS + 1))
    # one summary line, not the config as JSON; then what the demo trains and what to watch
    assert lines[0].startswith(f"config: {out}/config.json | model demo") and not any(
        x.startswith("{") for x in lines
    )
    step1 = next(i for i, x in enumerate(lines) if x.startswith("step "))
    assert any(x.startswith("demo: ") for x in lines[:step1]) and any(
        x.startswith("watch: ") for x in lines[:step1]
    )
    # the step lines: the numbers of metrics.jsonl, with units, one loss column
    steps = [x for x in lines if x.startswith("step ")]
    assert len(steps) == STEPS
    for x, r in zip(steps, m, strict=True):
        assert x.startswith(
            f"step {r['step']:>4}/{STEPS} | loss {r['loss']:.4f} | "
            f"grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | {r['tokens']:,} tokens | "
            f"{r['step_time_s']:.2f} s | {r['tokens_per_s_per_gpu']:,.0f} tok/s/gpu"
        ), x
        assert x.count("loss") == 1
    # the closing summary: first and last loss as metrics.jsonl has them, and where the outputs are
    got = re.search(
        r"^loss on the predictable labels: (\S+) at step (\d+) -> (\S+) at step (\d+)",
        p.stdout,
        re.M,
    )
    assert got, p.stdout[-2000:]
    assert (got[1], int(got[2])) == (f"{m[0]['loss']:.4f}", m[0]["step"])
    assert (got[3], int(got[4])) == (f"{m[-1]['loss']:.4f}", m[-1]["step"])
    where = lines[-1]
    assert (
        where.startswith(f"outputs in {out}/")
        and f'AutoModelForCausalLM.from_pretrained("{out}/final")' in where
    )
    for name in (
        "metrics.jsonl",
        "config.json",
        "checkpoints",
        "final/model.safetensors",
        "final/config.json",
    ):
        assert os.path.exists(out / name), name
    # the init draws on CPU generators (model/seeded_init.py), never a DTensor random op, which
    # torch answers on a CPU mesh with "DTensor random operators may not have complete support"
    assert "DTensor random operators" not in p.stderr


def test_demo_export_loads_in_transformers(demo):
    """The summary's load line works as printed."""
    import torch
    from transformers import AutoModelForCausalLM

    from model.config import Qwen3Config
    from model.qwen3 import Qwen3
    from model.weights import load_safetensors

    _, out, _ = demo
    hf = AutoModelForCausalLM.from_pretrained(str(out / "final"), torch_dtype=torch.float32)
    ours = Qwen3(Qwen3Config.from_hf(str(out / "final")))
    load_safetensors(ours, str(out / "final"), progress=False)
    ids = torch.arange(32)[None] % 64
    with torch.no_grad():
        assert (hf(ids).logits - ours.logits(ids)).abs().max().item() <= 1e-4


def test_one_line_per_checkpoint_written(demo):
    _, out, p = demo
    written = [
        int(s) for s in re.findall(r"^checkpoint: \S+/step_(\d+) \(step (?:\d+)\)$", p.stdout, re.M)
    ]
    assert written == list(range(EVERY, STEPS + 1, EVERY)), p.stdout[-2000:]  # the last one too
    kept = sorted(d for d in os.listdir(out / "checkpoints") if d.startswith("step_"))
    assert kept == [f"step_{s:06d}" for s in written[-2:]]  # --keep-checkpoints 2


# ---------------------------------------------------------------------------------------------
# OUT/config.json is the run
# ---------------------------------------------------------------------------------------------
def test_config_json_reruns_the_same_run(demo):
    tmp, out, _ = demo
    saved = json.load(open(out / "config.json"))
    assert set(saved) == {f.name for f in dataclasses.fields(train.TrainConfig)}
    again = tmp / "again"
    cfg = train.parse_args(["--config", str(out / "config.json"), "--out", str(again)])
    assert cfg == dataclasses.replace(train.TrainConfig(**saved), out=str(again))
    run_train(1, "--config", str(out / "config.json"), "--out", str(again), "--report-to", "none")
    a, b = _metrics(out), _metrics(again)
    assert [(r["loss"], r["grad_norm"], r["lr"], r["tokens"]) for r in a] == [
        (r["loss"], r["grad_norm"], r["lr"], r["tokens"]) for r in b
    ]
    resaved = json.load(open(again / "config.json"))
    assert {**resaved, "out": saved["out"], "report_to": saved["report_to"]} == saved


def test_config_with_unknown_field_is_refused(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"lr": 1e-3, "learning_rate": 1e-3}))
    with pytest.raises(train.ConfigError, match="unknown fields learning_rate"):
        train.parse_args(["--config", str(bad)])


# ---------------------------------------------------------------------------------------------
# --report-to tensorboard
# ---------------------------------------------------------------------------------------------
def test_tensorboard_has_the_losses_of_metrics_jsonl(demo):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    _, out, _ = demo
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={SCALARS: 0})
    acc.Reload()
    m = _metrics(out)
    for field in ("loss", "grad_norm", "tokens_per_s_per_gpu"):
        events = acc.Scalars(field)
        assert [e.step for e in events] == [r["step"] for r in m], field
        assert [e.value for e in events] == pytest.approx([r[field] for r in m], rel=1e-6), (
            field
        )  # float32
    evals = eval_records(out)  # before the first step and after the last, each bucket too
    events = acc.Scalars("eval_loss")
    assert [e.step for e in events] == [r["step"] for r in evals] == [0, STEPS]
    assert [e.value for e in events] == pytest.approx([r["eval_loss"] for r in evals], rel=1e-6)
    last_bucket = acc.Scalars("eval_loss_by_position/000000256-000000512")
    assert [e.value for e in last_bucket] == pytest.approx(
        [r["loss_by_position"][-1][2] for r in evals], rel=1e-6
    )
