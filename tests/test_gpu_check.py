"""bench/gpu_check.py end to end and bench/bench_attention.py on tiny CPU shapes, so they cannot
rot; and the exchange-volume arithmetic against the bytes model/ulysses_exchange.py hands to
all_to_all_single, counted in two gloo processes running checkpointed (offloaded) decoder layers.

    pytest tests/test_gpu_check.py -q
"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from memory.plan import plan
from model.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("loss", "layers", "attention", "backends", "optimizer", "int32", "cpu_offload")
SECTIONS += ("documents", "gdn", "attention_hd256", "hybrid_layer", "projection")


def _script(name, *args, timeout=120):
    """Run bench/<name> as a user does, from the repository root; fail with its output."""
    p = subprocess.run(
        [sys.executable, os.path.join("bench", name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _finite(d, keys, where, nonnegative=True):
    for k in keys:
        v = d[k]
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), (
            f"{where}.{k} = {v!r}"
        )
        assert v >= 0 or not nonnegative, f"{where}.{k} = {v!r}"


def _all_numbers_finite(obj, path="results"):
    """No NaN or infinity anywhere in the JSON (None is allowed, with a stated reason nearby)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _all_numbers_finite(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _all_numbers_finite(v, f"{path}[{i}]")
    elif isinstance(obj, float):
        assert math.isfinite(obj), f"{path} = {obj}"


def test_gpu_check_tiny_end_to_end(tmp_path):
    out = tmp_path / "results.json"
    # A budget no loaded machine runs out of: the parts skip work, and the CPU-offload part stops
    # its train.py, by the time left, which is what a GPU's check needs and not what this tests
    text = _script(
        "gpu_check.py",
        "--device",
        "cpu",
        "--tiny",
        "--budget-s",
        "3600",
        "--out",
        str(out),
        timeout=1800,  # a hang, not a slow machine
    )
    r = json.loads(out.read_text())
    _all_numbers_finite(r)
    for s in SECTIONS:
        assert r[s]["status"] == "ok", (s, r[s])
        _finite(r[s], ["process_peak_gb"] if s != "projection" else [], s)
    assert r["device"] == "cpu" and r["torch"] == torch.__version__
    _finite(r["loss"], ["time_s", "tflops", "N", "H", "V"], "loss")
    _finite(r["layers"], ["tokens", "local_attention_s"], "layers")
    # tiny CPU timings are noise: a per-layer difference may come out negative, but not NaN
    _finite(r["layers"], ["per_layer_s", "per_layer_nonattn_s"], "layers", nonnegative=False)
    _finite(r["layers"]["local_attention"], ["fwd_s", "bwd_s"], "layers.local_attention")
    assert r["layers"]["working_set"]["planned_gb"] > 0
    # The stacks ran as training does: attention once, so L-1 layers' input [T, H], out [T, nh, hd]
    # and fp32 lse [nh, T] went through the pool (tiny: T=256, H=64, 4 heads of 32, fp32), reserved
    # before step 1.
    T = r["layers"]["tokens"]
    per_layer = T * 64 * 4 + T * 4 * 32 * 4 + 4 * T * 4
    for L, run in r["layers"]["runs"].items():
        assert run["d2h_mib"] * 2**20 == (int(L) - 1) * per_layer, (L, run)
        assert run["host_allocs_after_reserve"] == 0
    assert r["layers"]["backend"] == "cpu_flash"
    # the pinning rate, which the dry run's --calibration reads for the time to the first step
    from memory.steptime import read_calibration

    biggest = max(r["layers"]["runs"].values(), key=lambda run: run["pinned_mib"])
    pin_gbps = biggest["pinned_mib"] * 2**20 / biggest["reserve_s"] / 1e9
    assert r["layers"]["pin_gbps"] == pytest.approx(pin_gbps, rel=1e-12)
    assert read_calibration(str(out)).pin_gbps == pytest.approx(pin_gbps, rel=1e-12)
    assert r["layers"]["working_set"]["attention_workspace"]["planned_gb"] > 0
    _finite(r["attention"], ["fwd_s", "bwd_s", "fwd_tflops", "bwd_tflops"], "attention")
    assert r["attention"]["backend"] == r["attention"]["backend_pinned"] == "cpu_flash", r[
        "attention"
    ]["backend_errors"]
    b = r["backends"]  # CPU: cpu_flash against math, the same code as cuDNN against flash on a GPU
    assert b["skipped"] is None and b["backends"] == ["cpu_flash", "math"] and b["agree"] is True
    for t in ("out", "dq", "dk", "dv"):
        _finite(b["diffs"][t], ["max_abs", "max_ref", "rel"], f"backends.{t}")
        assert b["diffs"][t]["rel"] < 1e-5  # fp32: rounding only
    # train.py's probe and its fallback: on CPU cpu_flash probed, then math when it is made to fail
    assert b["probe"] == {"cpu_flash": "ok", "math": "ok"} and b["chosen"] == "cpu_flash"
    assert (b["probe_tokens"], b["probe_heads"]) == (512, [2, 1])  # the rank's shape, as train.py
    assert (b["fallback"], b["fallback_why"]) == ("math", "cpu_flash: failure injected")
    # the loss at three chunk sizes, each timed with its memory
    assert [run["chunk_rows"] for run in r["loss"]["runs"]] == [32, 128, 256]
    for run in r["loss"]["runs"]:
        _finite(run, ["time_s", "peak_mem_gb"], "loss.runs")
    # the int32 part's check ran (tiny: far below 2^31 elements) and agreed with the reference;
    # train.py's rule at that length pins the same kernel, passing none over
    i = r["int32"]
    assert (i["q_elements"], i["past_2_31"], i["agrees"], i["backend"]) == (
        512 * 4 * 32,
        False,
        True,
        "cpu_flash",
    )
    assert (i["chosen"], i["passed_over"]) == ("cpu_flash", [])
    # train.py --cpu-offload ran its steps; its last record came back
    c = r["cpu_offload"]
    assert (c["model"], c["step"]) == ("tiny", 2) and c["planned_peak_gb"] > 0
    _finite(c, ["loss", "step_time_s"], "cpu_offload")
    _finite(r["optimizer"], ["time_s", "params_per_gpu"], "optimizer")
    # rows of documents at the rank's shape (CPU: one call per document, against itself on the
    # pinned kernel), each row's time per layer over the stream's in the projection
    d = r["documents"]
    assert (d["tokens"], d["heads"], d["documents_kernel"]) == (512, [2, 1, 32], "segments")
    assert (d["long"]["documents"], d["short"]["documents"]) == (11, 100)
    assert d["short"]["ones"] > 0 and d["long"]["longest"] == 512 - 10 * (512 // 11)
    # the mixed row: 50 short documents over 384 tokens, then one of 128, also timed as two
    # calls split by length; each row's FLOPs: 7 x sum of squares x 2 heads x 32 (step_flops')
    m = d["mixed"]
    assert (m["documents"], m["longest"]) == (51, 128)
    _finite(m, ["bucketed_per_layer_s"], "documents.mixed")
    assert m["empty_blocks_s"] == pytest.approx(m["per_layer_s"] - m["bucketed_per_layer_s"])
    books = 10 * (512 // 11) ** 2 + (512 - 10 * (512 // 11)) ** 2
    assert d["long"]["attention_flops"] == 3.5 * 2 * books * 2 * 32
    for row in ("long", "short", "mixed"):
        _finite(d[row], ["first_call_s", "per_layer_s"], f"documents.{row}")
        _finite(d[row], ["first_call_overhead_s"], f"documents.{row}", nonnegative=False)
        assert d[row]["agrees"] is True and max(d[row]["vs_per_document"].values()) == 0.0
        want = d[row]["per_layer_s"] / r["projection"]["terms"]["attention_s"]
        assert r["projection"][f"documents_{row}_vs_stream"] == pytest.approx(want, rel=1e-12)
    # Qwen3.5's parts (tiny: 2 key and 4 value heads of 16 a rank over 512 tokens; 2 query
    # heads of 32): the delta rule on each kernel that runs here (CPU: ours alone) against the
    # fp32 reference, and its rate, which --calibration carries into the dry run; attention at
    # the hybrid's head_dim, carried for a model with head_dim 256; one attention layer.
    from memory.model_size import gdn_flops

    gd = r["gdn"]
    assert (gd["tokens"], gd["hk"], gd["hv"], gd["dk"], gd["dv"]) == (512, 2, 4, 16, 16)
    assert gd["chosen"] == "ours" and gd["kernels"]["ours"]["agrees"] is True
    assert "CUDA only" in gd["passed_over"]["fla"]
    assert gd["flops"] == pytest.approx(sum(gdn_flops(load_config("qwen3.5-tiny"), 512)) / 2)
    _finite(gd, ["time_s", "tflops"], "gdn")
    assert gd["scan_vs_loop"]["tokens"] == 512 // 8  # the scan against the textbook loop
    _finite(gd["scan_vs_loop"], ["scan_s", "loop_s", "loop_over_scan"], "gdn.scan_vs_loop")
    rates = read_calibration(str(out))
    assert rates.gdn_tflops == pytest.approx(gd["flops"] / gd["time_s"] / 1e12, rel=1e-12)
    assert "gdn_tflops" in rates.measured
    wide = r["attention_hd256"]
    assert wide["q_shape"] == [1, 512, 2, 32] and wide["check"]["agree"] is True
    assert rates.attention_fwd_tflops == pytest.approx(r["attention"]["fwd_tflops"], rel=1e-9)
    as256 = read_calibration(str(out), head_dim=256)
    assert as256.attention_fwd_tflops == pytest.approx(wide["fwd_tflops"], rel=1e-9)
    assert as256.attention_bwd_tflops == pytest.approx(wide["bwd_tflops"], rel=1e-9)
    h = r["hybrid_layer"]
    assert (h["tokens"], h["layer_index"], h["backend"]) == (256, 3, "cpu_flash")
    _finite(h, ["per_layer_s", "local_attention_s"], "hybrid_layer")
    p = r["projection"]
    _finite(p, ["planner_floor_s", "planner_flops", "a2a_s", "planner_peak_gb"], "projection")
    _finite(p, ["step_s", "layer_s"], "projection", nonnegative=False)
    t = p["terms"]  # the arithmetic adds up as printed
    assert p["step_s"] == pytest.approx(
        t["layers"] * (t["layer_nonattn_s"] + t["attention_s"])
        + t["loss_s"]
        + t["a2a_s"]
        + t["optimizer_s"],
        rel=1e-9,
    )
    # attention once: forward + backward per layer, not 2 x forward + backward
    assert t["attention_s"] == pytest.approx(
        r["attention"]["fwd_s"] + r["attention"]["bwd_s"], rel=1e-12
    )
    assert p["step_s_attention_recomputed"] == pytest.approx(
        p["step_s"] + t["layers"] * r["attention"]["fwd_s"]
    )
    assert (
        p["planner_flops"]
        == plan(
            load_config("tiny"), 512, gpus=2, sp=2, compute_bytes=4, save_attention=True
        ).flops.no_attn_recompute
    )
    assert (
        p["public_recipe"]["step_time_s"] == 380.0 and p["public_recipe"]["peak_gb_per_gpu"] == 56.2
    )
    assert "step" in text and "PROJECTED" in text


def test_int32_part_when_the_pinned_kernel_is_wrong_at_its_length(monkeypatch):
    """The int32 part on a kernel that is wrong at the part's length (as an H200's cuDNN was past
    2^31 q elements): it says so, and which kernel train.py's rule pins there instead; when no
    kernel agrees, that a run of this shape is refused."""
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))
    from bench import gpu_check

    def probe(name, *shape, tokens=None):
        return "dq planted off" if name == "cpu_flash" else None

    monkeypatch.setattr(gpu_check, "probe_kernel", probe)
    r = gpu_check.part_int32(gpu_check.TINY, torch.device("cpu"), 60.0)
    assert (r["backend"], r["agrees"], r["reason"]) == ("cpu_flash", False, "dq planted off")
    assert (r["chosen"], r["passed_over"]) == ("math", ["cpu_flash: dq planted off"])

    def refuse(*args, **kwargs):  # on CUDA: neither cuDNN nor flash agrees (CPU keeps math)
        raise ValueError("attention: neither kernel agrees (planted)")

    monkeypatch.setattr(gpu_check, "choose_kernel", refuse)
    r = gpu_check.part_int32(gpu_check.TINY, torch.device("cpu"), 60.0)
    assert (r["agrees"], r["chosen"], r["reason"]) == (
        False,
        None,
        "attention: neither kernel agrees (planted)",
    )


def test_bench_attention_tiny():
    """run() and the exchange table at the tiny shapes (what gpu_check's attention part runs)."""
    from bench.bench_attention import exchange_volumes, format_exchange, run

    r = json.loads(json.dumps(run(512, 2, model="tiny", device="cpu", tiny=True)))
    text = format_exchange(exchange_volumes(load_config("tiny"), 512, 2, bytes_per_elem=4))
    _finite(r, ["fwd_s", "bwd_s", "fwd_bwd_s", "fwd_tflops", "fwd_flops", "bwd_flops"], "attention")
    assert r["backend"] == r["backend_pinned"] == "cpu_flash" and "flash" in r["backend_ran"]
    assert r["q_shape"] == [1, 512, 2, 32] and r["kv_shape"] == [1, 512, 1, 32]
    assert r["bwd_flops"] == 2.5 * r["fwd_flops"] == 2.5 * 2 * 512**2 * 2 * 32
    assert "PROJECTED" in text


def test_compare_backends_skips_a_backend_that_cannot_run():
    from bench.bench_attention import compare_backends
    from bench.table import figures

    c = compare_backends(256, 4, 1, 32, device="cpu", pair=("cudnn", "flash"))
    assert c["skipped"].startswith("cudnn cannot run 4 query / 1 kv heads") and "diffs" not in c
    assert "skipped=cudnn cannot run" in figures(c)


def test_bench_attention_times_the_pinned_backend(monkeypatch):
    """run() pins the backend pick_backend chooses (as train.py does), and every attention() call
    inside runs it: a forced choice of math shows up as math's ops, not the CPU flash kernel."""
    import bench.bench_attention as ba
    from model.attention import get_backend

    monkeypatch.setattr(ba, "pinned_backend", lambda *a, **k: "math")
    r = ba.run(256, 2, model="tiny", device="cpu", tiny=True)
    assert (
        r["backend"] == r["backend_pinned"] == "math" and r["backend_ops"] == []
    )  # no fused SDPA op ran
    assert get_backend() is None  # restored afterwards


def test_exchange_table_qwen3_8b():
    from bench.bench_attention import exchange_volumes
    from model.config import Qwen3Config

    ex = exchange_volumes(Qwen3Config.preset("qwen3-8b"), 1_048_576, 8)
    fwd = {r["tensor"]: r["buffer_bytes"] for r in ex["rows"] if r["phase"] == "forward"}
    assert fwd == {"q": 2**30, "k": 2**28, "v": 2**28, "out": 2**30}  # [131072, 32 or 8, 128] bf16
    assert ex["sent_per_layer"]["total"] == 3 * 7 * (2 * 2**30 + 2 * 2**28) // 8


# ---- the arithmetic against what really goes through all_to_all_single --------------------
TOKENS = 16
CASES = {
    "repeat": dict(num_key_value_heads=1),
    "gqa": dict(num_key_value_heads=2),
}  # tiny: 4 q heads


def _count_exchanges(rank, world, case):
    """Checkpointed, offloaded Qwen3 layers under Ulysses; every all_to_all_single call's input
    shape and bytes, in forward and in backward (recompute included)."""
    from model.checkpoint_offload import apply_offload
    from model.config import Qwen3Config
    from model.qwen3 import Qwen3
    from model.ulysses import UlyssesAttention

    cfg = dataclasses.replace(Qwen3Config.preset("tiny"), **CASES[case])
    torch.manual_seed(0)
    model = Qwen3(cfg)
    model.set_attention(UlyssesAttention(dist.group.WORLD))
    apply_offload(model, min_bytes=0)  # what train.py wraps every layer in
    calls, phase = [], ["forward"]
    real = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        calls.append(
            (
                phase[0],
                tuple(input.shape),
                input.numel() * input.element_size(),
                output.numel() * output.element_size(),
            )
        )
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = counting  # ulysses looks it up on torch.distributed at call time
    try:
        ids = torch.randint(
            0, cfg.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(1)
        )
        sl = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
        pos = torch.arange(TOKENS)[None, sl]
        h = model(ids[:, sl], pos)
        phase[0] = "backward"
        h.square().sum().backward()
    finally:
        dist.all_to_all_single = real
    return calls


@pytest.mark.slow
def test_exchange_volumes_equal_all_to_all_bytes():
    from bench.bench_attention import exchange_volumes
    from model.config import Qwen3Config

    world = 2
    per_rank = run_distributed(_run_cases, world)
    for case, overrides in CASES.items():
        cfg = dataclasses.replace(Qwen3Config.preset("tiny"), **overrides)
        ex = exchange_volumes(cfg, TOKENS, world, bytes_per_elem=4)  # fp32 model on gloo
        for calls in (r[case] for r in per_rank):
            for phases, seen in (
                (("forward",), "forward"),
                (("recompute", "backward"), "backward"),
            ):
                want = sorted(
                    [
                        (tuple(r["buffer_shape"]), r["buffer_bytes"])
                        for r in ex["rows"]
                        if r["phase"] in phases
                    ]
                    * cfg.num_hidden_layers
                )
                got = sorted((shape, nbytes) for ph, shape, nbytes, _ in calls if ph == seen)
                assert got == want, (case, seen)
                assert all(i == o for ph, _, i, o in calls)  # equal send and receive buffers
            sent = sum(nbytes * (world - 1) // world for *_, nbytes, _ in calls)
            assert sent == ex["sent_per_step"]


def _run_cases(rank, world):
    return {case: _count_exchanges(rank, world, case) for case in CASES}
