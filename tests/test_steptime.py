"""memory/steptime.py against the public runs' measured steps, a planted counting error, a
calibration JSON shaped as bench/gpu_check.py writes it, and the dry run's sweep.

    pytest tests/test_steptime.py -q -s     # -s prints every public run with its deviation

The reference is huggingface/trl pull request #6845's measured table (8 x H100 per node, bf16,
chunked loss, context parallelism over all the GPUs, whole-layer checkpointing), copied here as
the test's own numbers rather than read from the module under test.
"""

import json
import time
from dataclasses import replace

import pytest
from dist_utils import run_train

import memory.steptime as steptime
from bench.bench_attention import exchange_volumes
from memory.plan import GB, plan
from memory.report import format_plan
from memory.steptime import (
    assumed_rates,
    exchange_bytes,
    format_public_runs,
    measured_parts,
    project,
    public_configuration,
    read_calibration,
    startup,
)
from memory.sweep import GPU_COUNTS, LENGTHS, format_sweep, sweep
from model.config import PRESETS
from run.checks import check_flags

QWEN3_8B = PRESETS["qwen3-8b"]
T_1M = 1_048_576

# (preset, tokens in the one row, GPUs, measured seconds per step)
MEASURED_LONG = [
    ("qwen3-0.6b", 1_048_576, 8, 137.0),
    ("qwen3-8b", 1_048_576, 8, 364.0),
    ("qwen3-8b", 1_048_576, 8, 380.0),  # the merged guide's figure (#6846) for the same run
    ("qwen3-32b", 1_048_576, 8, 1295.0),
    ("qwen3-0.6b", 4_194_304, 8, 2135.0),
    ("qwen3-8b", 2_097_152, 16, 696.0),
    ("qwen3-8b", 4_194_304, 32, 1346.0),
]
MEASURED_SHORT = [("qwen3-4b", 131_072, 2, 34.6), ("qwen3-4b", 131_072, 4, 17.8)]
MEASURED_SHORT += [("qwen3-4b", 131_072, 8, 9.5)]


def _deviations(runs, **options) -> list[float]:
    """projected / measured - 1 for each run at the public configuration."""
    out = []
    for model, seq_len, gpus, measured in runs:
        p = public_configuration(PRESETS[model], seq_len, gpus, **options)
        t = project(p)
        out.append(t.step_s / measured - 1)
        print(
            f"{model:11} {seq_len:>10,} tokens {gpus:>2} GPUs: measured {measured:7.1f} s, "
            f"projected {t.step_s:7.1f} s ({100 * out[-1]:+.1f}%)"
        )
    return out


# ---- against the public runs -----------------------------------------------------------------
def test_public_runs_of_a_million_tokens_or_more_within_10_percent():
    deviations = _deviations(MEASURED_LONG)
    assert all(abs(d) <= 0.10 for d in deviations), deviations


def test_public_runs_of_131k_tokens_are_printed_and_flagged_as_optimistic():
    """One rate does not explain them: they ran 26-32% slower than it says. The table prints
    them with their deviation and the sweep warns that its short rows read optimistic."""
    deviations = _deviations(MEASURED_SHORT)
    assert all(d < -0.10 for d in deviations), deviations  # else the sweep's warning is wrong
    text = format_public_runs()
    for model, seq_len, gpus, measured in MEASURED_SHORT:
        row = next(
            ln for ln in text.splitlines() if f"{seq_len:,}" in ln and f"{measured:.1f} s" in ln
        )
        assert row.split()[:3] == [model, f"{seq_len:,}", str(gpus)] and "%" in row
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8)
    assert "rows under 1,048,576 tokens read optimistic" in format_sweep(p, sweep(p))


def test_a_planted_counting_error_falls_outside_the_tolerance(monkeypatch):
    """Attention's backward counted as 2x its forward, or the recompute left out: some public run
    lands more than 10% off, so the test above tells them from the right count."""
    assert max(abs(d) for d in _deviations(MEASURED_LONG, attn_bwd_factor=2.0)) > 0.10
    real = steptime.step_flops

    def no_recompute(*args, **kwargs):
        f = real(*args, **kwargs)
        return {**f, "no_attn_recompute": f["model"], "full_recompute": f["model"]}

    monkeypatch.setattr(steptime, "step_flops", no_recompute)
    assert max(abs(d) for d in _deviations(MEASURED_LONG)) > 0.10


# ---- the model's parts -----------------------------------------------------------------------
@pytest.mark.parametrize("save_attention", [True, False])
def test_phases_add_up_to_the_planners_flops_and_the_floor_is_100_percent(save_attention):
    p = plan(QWEN3_8B, T_1M, gpus=16, sp=8, save_attention=save_attention)
    t = project(p)
    assert sum(ph.flops for ph in t.phases) == pytest.approx(p.flops.step / 16, rel=1e-12)
    assert t.floor_s == pytest.approx(p.flops.step / (16 * 989e12), rel=1e-12)
    assert [ph.bound for ph in t.phases][::2] == ["attention kernels", "attention kernels"]


@pytest.mark.parametrize("config, sp", [(QWEN3_8B, 8), (QWEN3_8B, 16), (PRESETS["qwen3-14b"], 8)])
def test_exchange_bytes_match_bench_attentions_exchange_volumes(config, sp):
    """bench_attention.exchange_volumes is checked against the bytes model/ulysses.py hands
    all_to_all_single (tests/test_gpu_check.py); kv heads repeat when sp exceeds them."""
    ex = exchange_volumes(config, T_1M, sp)
    assert exchange_bytes(config, T_1M, sp) == pytest.approx(ex["sent_per_layer"]["forward"], 1e-9)


def test_a_host_copy_slower_than_the_layers_compute_bounds_the_phase():
    """At 0.5 GB/s a layer's offloaded input and attention (2.2 GB) outlast its forward (2.2 s
    of kernels): the forward takes layers x the copy, plus the all-to-alls."""
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=True)
    slow = replace(assumed_rates(), pcie_gbps=0.5)
    forward = project(p, slow).phases[0]
    L = QWEN3_8B.num_hidden_layers
    copy = p.host.offload_bytes_per_step / 2 / L / 0.5e9
    assert forward.bound == "host copies out beyond the compute beside them"
    assert forward.time_s == pytest.approx(L * copy + forward.terms["all-to-all"], rel=1e-12)
    assert project(p).phases[0].bound == "attention kernels"  # at 25 GB/s the copy hides


def test_cpu_offload_puts_adamw_on_the_host_and_its_time_in_the_step():
    p = plan(QWEN3_8B, 131_072, gpus=8, sp=8, cpu_offload=True)
    optimizer = project(p).phases[-1]
    assert optimizer.bound == "CPU AdamW"
    assert optimizer.time_s == pytest.approx(p.cpu_offload_cost.adamw_time_s, rel=1e-12)


def test_time_to_first_step_counts_each_ranks_rows_and_the_pinned_pool():
    p = plan(QWEN3_8B, T_1M, gpus=16, sp=8, save_attention=True)
    s = startup(p)
    assert s.weights_bytes_per_node == pytest.approx(QWEN3_8B.num_params() * 2 / 2, rel=1e-12)
    pool = p.host.saved_inputs_per_gpu + p.host.saved_attention_per_gpu
    assert s.pinned_bytes_per_process == pool and s.pin_s == pytest.approx(pool / 4e9)
    # the probe: one layer's attention, forward (4 T^2 hd heads / 2, causal) and backward (2.5 x
    # the forward: dq, dk, dv and the recomputed scores), on one of 8 ranks at the assumed rate
    c, r = QWEN3_8B, assumed_rates()
    forward = 4 * T_1M**2 * c.head_dim * c.num_attention_heads / 2 / 8
    assert r.attention_fwd_tflops == r.attention_bwd_tflops
    assert s.probe_s == pytest.approx(3.5 * forward / (r.attention_fwd_tflops * 1e12), rel=1e-3)
    rest = s.weights_bytes_per_node / 2e9 + pool / 4e9
    assert s.time_s == pytest.approx(15 + s.probe_s + rest)


# ---- calibration -----------------------------------------------------------------------------
def _gpu_check_json(path, fwd_s=2.0, bwd_s=5.0, attention_status="ok"):
    """Exactly the fields read_calibration reads, as bench/gpu_check.py writes them (its FULL
    geometry: Qwen3-8B, 1,048,576 tokens, sp=8)."""
    d = {
        "model": "qwen3-8b",
        "seq_len": T_1M,
        "sp": 8,
        "device": "NVIDIA H200 (written by the test)",
        "layers": {
            "status": "ok",
            "per_layer_nonattn_s": 0.5,
            "runs": {"2": {"reserve_s": 4.0, "pinned_mib": 8192.0}},
        },
        "attention": {"status": attention_status, "fwd_s": fwd_s, "bwd_s": bwd_s},
        "loss": {"status": "ok", "time_s": 1.5},
        "optimizer": {"status": "ok", "time_s": 0.02},
    }
    path.write_text(json.dumps(d))
    return str(path)


def test_calibration_projects_gpu_checks_arithmetic_from_its_numbers(tmp_path):
    """At gpu_check's own shape the step is its projection: layers x (layer without attention +
    attention forward + backward) + loss + all-to-all + optimizer; more attention backward adds
    layers x that; recomputing attention adds its forward once more per layer."""
    L = QWEN3_8B.num_hidden_layers
    a2a = exchange_volumes(QWEN3_8B, T_1M, 8)["projected_s_per_step"]
    once = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=True)
    again = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=False)
    rates = read_calibration(_gpu_check_json(tmp_path / "a.json"))
    assert project(once, rates).step_s == pytest.approx(L * 7.5 + 1.5 + a2a + 0.02, rel=1e-9)
    assert project(again, rates).step_s == pytest.approx(L * 9.5 + 1.5 + a2a + 0.02, rel=1e-9)
    slower = read_calibration(_gpu_check_json(tmp_path / "b.json", bwd_s=6.0))
    assert project(once, slower).step_s - project(once, rates).step_s == pytest.approx(L, 1e-9)
    assert startup(once, rates).pin_s == pytest.approx(
        startup(once).pinned_bytes_per_process / (8192 * 2**20 / 4.0), rel=1e-12
    )
    assert set(rates.measured) == {
        "matmul_tflops",
        "attention_fwd_tflops",
        "attention_bwd_tflops",
        "loss_tflops",
        "adamw_s_per_param",
        "pin_gbps",
    }


def test_gpu_checks_sum_of_its_parts_is_the_calibrated_projection(tmp_path):
    """The step gpu_check prints (measured_parts' sum) is project() at gpu_check's shape with the
    rates read from the same JSON, attention once and recomputed; a part that did not run is
    missing, and its seconds are None."""
    L = QWEN3_8B.num_hidden_layers
    a2a = exchange_volumes(QWEN3_8B, T_1M, 8)["projected_s_per_step"]
    path = _gpu_check_json(tmp_path / "a.json", fwd_s=2.5, bwd_s=4.0)
    with open(path) as f:
        parts = measured_parts(json.load(f))
    assert parts.missing == () and parts.step_s(L, a2a) == pytest.approx(L * 7.0 + 1.52 + a2a)
    rates = read_calibration(path)
    for save in (True, False):
        p = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=save)
        projected = project(p, rates).step_s
        assert parts.step_s(L, a2a, save) == pytest.approx(projected, rel=1e-9), save
    with open(_gpu_check_json(tmp_path / "b.json", attention_status="timeout")) as f:
        partial = measured_parts(json.load(f))
    assert partial.missing == ("attention",) and partial.attention_fwd_s is None
    assert partial.loss_s == 1.5


def test_a_part_that_did_not_run_leaves_its_rate_assumed(tmp_path):
    rates = read_calibration(_gpu_check_json(tmp_path / "r.json", attention_status="timeout"))
    assert rates.attention_fwd_tflops == 530.0 and rates.says("attention_fwd_tflops") == "assumed"
    assert rates.says("matmul_tflops") == "measured"
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a gpu_check JSON"):
        read_calibration(str(tmp_path / "bad.json"))


# docs/numbers.md, one H200 in one process at the sp=8 rank's 1M-token shape: flash's forward and
# backward a layer, cuDNN's; and flash with cumulative lengths over 11 near-equal documents
FLASH_S, CUDNN_S, ELEVEN_BOOKS_S = 3.56 + 8.56, 2.30 + 5.28, 1.093


def _attention_seconds(t) -> float:
    return sum(ph.terms.get("attention kernels", 0.0) for ph in t.phases)


def test_two_documents_a_row_are_timed_at_flashs_rate_not_the_streams(tmp_path):
    """--doc-len 524288: two documents a row run flash's variable-length kernel, so their
    attention takes the documents' FLOPs at the stream's 530 TFLOP/s x cuDNN's 7.58 s over
    flash's 12.12 s (331 TFLOP/s); with a calibration, at its documents part's rate: 11 books of
    1,048,576 / 11 tokens on 4 heads of 128 in 1.093 s, forward + 2.5 x backward (328 TFLOP/s)."""
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=True, doc_len=524_288)
    L = QWEN3_8B.num_hidden_layers
    square = 2 * 524_288**2  # forward 2 x square x heads x head_dim a layer, 8 ranks
    fwd, bwd = L * 2.0 * square * 32 * 128, L * 2.5 * 2.0 * square * 32 * 128
    flash = 530e12 * CUDNN_S / FLASH_S * 8
    assert _attention_seconds(project(p)) == pytest.approx((fwd + bwd) / flash, rel=1e-9)
    stream_rate = (fwd + bwd) / (530e12 * 8)
    assert _attention_seconds(project(p)) > 1.5 * stream_rate  # not the stream's rate

    path = _gpu_check_json(tmp_path / "docs.json")
    d = json.loads((tmp_path / "docs.json").read_text())
    long = {"documents": 11, "longest": 95_326, "per_layer_s": ELEVEN_BOOKS_S}
    d["documents"] = {"status": "ok", "tokens": T_1M, "heads": [4, 1, 128], "long": long}
    (tmp_path / "docs.json").write_text(json.dumps(d))
    rates = read_calibration(path)
    books = 10 * 95_325**2 + 95_326**2  # 1,048,576 = 10 x 95,325 + 95,326
    measured = 3.5 * 2.0 * books * 4 * 128 / ELEVEN_BOOKS_S
    assert rates.documents_tflops * 1e12 == pytest.approx(measured, rel=1e-12)
    assert rates.says("documents_tflops") == "measured" and 320 < measured / 1e12 < 335
    t = project(p, rates)
    assert _attention_seconds(t) == pytest.approx((fwd + bwd) / (measured * 8), rel=1e-9)
    # the stream at the same rates: the attention part's 2.0 s a layer forward, not the documents'
    stream = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=True)
    assert project(stream, rates).phases[0].terms["attention kernels"] == pytest.approx(L * 2.0)


def test_dry_run_prints_the_projection_next_to_the_floor_and_follows_a_calibration(tmp_path):
    L = QWEN3_8B.num_hidden_layers
    a2a = exchange_volumes(QWEN3_8B, T_1M, 8)["projected_s_per_step"]
    path = _gpu_check_json(tmp_path / "gpu_check.json")
    out = run_train(1, "--preset", "qwen3-8b-1m", "--dry-run", "--calibration", path).stdout
    lines = {ln.split("  ")[1].strip(): ln for ln in out.splitlines() if ln.startswith("  ")}
    assert f"{L * 7.5 + 1.5 + a2a + 0.02:.1f} s" in lines["step, projected"]
    assert "151.3 s" in lines["floor: 100% of 989 TFLOP/s"]
    assert "gpu_check on NVIDIA H200 (written by the test)" in out and "(measured)" in out
    assert "time to first step, projected" in out


def test_default_projection_is_the_public_rate_over_the_recipes_flops():
    """Attention once at 530 TFLOP/s: 1.197e18 / (8 x 530e12) = 282 s, plus 0.56 s of
    all-to-alls and 12 ms of AdamW; the floor (151 s) stays beside it, labelled."""
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8, save_attention=True, host_mem_gb=2000)
    assert project(p).step_s == pytest.approx(p.flops.step / (8 * 530e12), rel=0.005)
    text = format_plan(p)
    assert f"{project(p).step_s:.1f} s" in text and "the limit, not a projection" in text


def test_sweep_and_calibration_need_a_dry_run():
    from model.config import ConfigError
    from train import TrainConfig

    for flags in ({"sweep": True}, {"calibration": "gpu_check.json"}):
        with pytest.raises(ConfigError, match="given with --dry-run"):
            check_flags(TrainConfig(**flags))
        check_flags(TrainConfig(dry_run=True, **flags))


# ---- the sweep -------------------------------------------------------------------------------
def test_sweep_covers_every_length_gpu_count_and_attention_setting():
    p = plan(QWEN3_8B, T_1M, gpus=8, sp=8, host_mem_gb=2000, tiled_mlp=True, mlp_tile=16384)
    t0 = time.perf_counter()
    rows = sweep(p)
    text = format_sweep(p, rows)
    print(f"sweep: {len(rows)} plans and the table in {time.perf_counter() - t0:.2f} s")
    assert {(r.seq_len, r.gpus, r.save_attention) for r in rows} == {
        (n, g, kept) for n in LENGTHS for g in GPU_COUNTS for kept in (True, False)
    }
    assert LENGTHS[0] == 131_072 and LENGTHS[-1] == 8_388_608 and GPU_COUNTS == (8, 16, 32)
    row = next(r for r in rows if (r.seq_len, r.gpus, r.save_attention) == (4_194_304, 16, True))
    q = plan(QWEN3_8B, 4_194_304, gpus=16, sp=8, options=row.plan.options)
    line = next(ln for ln in text.splitlines() if ln.split()[:2] == ["4,194,304", "16"])
    assert line.split()[3:7] == [
        f"{project(q).step_s:.0f}",
        f"{q.total / GB:.1f}",
        f"{q.host.per_node / GB:.0f}",
        "no:",  # attention kept needs more than 2000 GB of host per node at 4M tokens
    ]
    assert "1,048,576 tokens,  8 GPUs: measured 364 s" in text


def test_a_hybrid_times_attention_on_its_attention_layers_and_the_delta_rule_apart():
    """Qwen3.5-9B at 1M tokens on 8 GPUs, attention once: the attention kernels' forward is its 8
    full-attention layers' FLOPs (2 x T^2/2 x 2 per head of 256, 16 heads) over the sp ranks at
    530 TFLOP/s; the delta rule's is its own term at Rates.gdn_tflops (assumed, a tenth of the
    kernel rate), which a calibration's rate replaces alone; and the output names it assumed."""
    c = PRESETS["qwen3.5-9b"]
    p = plan(c, T_1M, gpus=8, sp=8, save_attention=True)
    forward = project(p).phases[0].terms
    attention = 8 * 2 * T_1M * T_1M * 16 * 256  # 8 layers, QK^T and PV, causal
    assert forward["attention kernels"] == pytest.approx(attention / 8 / 530e12, rel=1e-9)
    gdn = 24 * 32 * 535_808 * T_1M  # 24 layers x 32 value heads x the chunk form's and scan's
    assert forward["GDN kernels"] == pytest.approx(gdn / 8 / 53e12, rel=1e-9)
    faster = project(p, replace(assumed_rates(), gdn_tflops=106.0)).phases[0].terms
    assert faster["GDN kernels"] == pytest.approx(forward["GDN kernels"] / 2, rel=1e-9)
    assert faster["attention kernels"] == forward["attention kernels"]
    assert "Gated DeltaNet delta rule 53 TFLOP/s (assumed, projected" in format_plan(p)
    # a Qwen3 has no such term, and its step is what it was
    assert "GDN kernels" not in project(plan(QWEN3_8B, T_1M, gpus=8, sp=8)).phases[0].terms
