"""Live metrics (run/report.py) read back by the backends' own readers."""

import glob
import json
import struct
import sys

import numpy as np
import pytest

from run.report import Reporter, ReportError, check_available, parse_report_to, scalars, wandb_mode


# What train.py writes to metrics.jsonl for one step on CPU (no peak memory, no MFU).
def _record(step: int) -> dict:
    return {
        "step": step,
        "loss": 4.5 / step,
        "grad_norm": 1.0 + 0.1 * step,
        "lr": 5e-3 * step,
        "tokens": 257 * step,
        "step_time_s": 0.07 + 0.01 * step,
        "tokens_per_s": 3600.0 + step,
        "tokens_per_s_per_gpu": 1800.5,
        "peak_mem_gb": None,
        "mfu": None,
    }


FIELDS = {
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
}


# ---------------------------------------------------------------------------------------------
# TensorBoard: the event file, read back with TensorBoard's EventAccumulator
# ---------------------------------------------------------------------------------------------
def _tb_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0})
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
    }, acc


def test_tensorboard_event_file_holds_every_field_of_each_step(tmp_path):
    pytest.importorskip("tensorboard")
    config = {"lr": 5e-3, "data": "synthetic:repeat", "steps": 3}
    with Reporter(["tensorboard"], str(tmp_path), "demo", config) as rep:
        for s in (1, 2, 3):
            rep.log(_record(s), s)
    got, acc = _tb_scalars(tmp_path / "tensorboard")
    assert set(got) == FIELDS  # None (peak memory, MFU on CPU) left out, "step" is the axis
    for tag, events in got.items():
        # event files hold float32
        assert events == [(s, float(np.float32(_record(s)[tag]))) for s in (1, 2, 3)], tag
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text) == config


def test_tensorboard_resume_hides_the_steps_it_rewrites(tmp_path):
    pytest.importorskip("tensorboard")
    with Reporter(["tensorboard"], str(tmp_path)) as rep:  # first launch: steps 1-4, then a crash
        for s in (1, 2, 3, 4):
            rep.log({"step": s, "loss": 10.0 + s}, s)
    with Reporter(
        ["tensorboard"], str(tmp_path), first_step=3
    ) as rep:  # resumed from the step-2 checkpoint
        for s in (3, 4, 5):
            rep.log({"step": s, "loss": 20.0 + s}, s)
    got, _ = _tb_scalars(tmp_path / "tensorboard")
    assert got["loss"] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0)]


# ---------------------------------------------------------------------------------------------
# W&B offline: the run file, read back with W&B's own protobuf records
# ---------------------------------------------------------------------------------------------
def _wandb_records(path: str) -> list:
    """Records of a .wandb file: a 7-byte header, then LevelDB-log chunks (crc32c, length, type)
    in 32 KiB blocks; each complete payload is one wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = open(path, "rb").read(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _items(items) -> dict:
    """A record's key/value_json items (W&B writes either `key` or `nested_key`) as a dict."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def test_wandb_offline_run_without_an_account_records_each_step(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in (
        "WANDB_MODE",
        "WANDB_API_KEY",
        "WANDB_IDENTITY_TOKEN_FILE",
        "WANDB_BASE_URL",
        "WANDB_PROJECT",
    ):
        monkeypatch.delenv(var, raising=False)
    for var in (
        "WANDB_CONFIG_DIR",
        "WANDB_CACHE_DIR",
        "WANDB_DATA_DIR",
    ):  # nothing written outside tmp_path
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert wandb_mode() == "offline"
    config = {"lr": 5e-3, "steps": 3}
    try:
        with Reporter(["wandb"], str(tmp_path), "demo", config) as rep:
            for s in (1, 2, 3):
                rep.log(_record(s), s)
    finally:
        wandb.teardown()  # stop W&B's service process; later tests should not share it
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = _wandb_records(run_file)
    history = [
        (
            r.history.step.num,
            {k: v for k, v in _items(r.history.item).items() if not k.startswith("_")},
        )
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert history == [(s, scalars(_record(s))) for s in (1, 2, 3)]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("qwen3-1m", "demo")
    assert {k: v for k, v in _items(run.config.update).items() if k in config} == config


def test_wandb_mode_follows_the_environment_then_credentials(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() == "offline"  # no file at all
    (tmp_path / "netrc").write_text(
        "machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n"
    )
    assert wandb_mode() == "online"  # what `wandb login` writes
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert wandb_mode() == "offline"  # a key for another host does not count
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


# ---------------------------------------------------------------------------------------------
# --report-to parsing and missing packages
# ---------------------------------------------------------------------------------------------
def test_report_to_accepts_commas_repeats_and_none():
    assert parse_report_to("none") == [] and parse_report_to(None) == []
    assert parse_report_to("tensorboard,wandb") == ["tensorboard", "wandb"]
    assert parse_report_to(["wandb", "tensorboard, wandb"]) == ["wandb", "tensorboard"]
    with pytest.raises(ReportError, match="'tensorbord'"):
        parse_report_to("tensorbord")


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_missing_package_fails_up_front_with_the_pip_command(kind, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, kind, None)  # `import kind` now raises ImportError
    with pytest.raises(ReportError) as err:
        check_available(parse_report_to(f"none,{kind}"))
    msg = str(err.value)
    assert f"python3 -m pip install {kind}" in msg and "\n" not in msg
    assert isinstance(err.value, ValueError)
    with pytest.raises(ReportError):
        Reporter([kind], str(tmp_path))
    assert not (tmp_path / kind).exists()
