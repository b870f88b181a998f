"""memory/layouts.py's chooser: against brute force on real hardware cases, through train.py on
CPU with a device budget that forces a mixed layout, and its file (--layout-out, --layout).

The brute force is independent of the chooser's search: it takes every (CPU offload, number of
layers keeping attention, split of those between device and host) and, for each, every number of
device inputs, through plan(). It leans on one property only, held below on full scans: with the
rest fixed, host memory falls and the GPU's peak grows as more inputs stay on the device, so the
inputs that fit form one range, found by bisection.
"""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from dist_utils import run_distributed, run_train
from hf_ref import hf_model, ref_loss_and_norm, save_hf
from test_train import CFG as TRAIN_CFG

from memory.layouts import Pins, StepLayout, choose_layout, read_layout
from memory.plan import plan
from memory.steptime import project
from model.checkpoint_offload import default_placements
from model.config import load_config

M = 2**20
# (model, tokens, GPUs per node = sp, GB per GPU, GB host per node)
CASES = [
    ("qwen3-0.6b", 1 * M, 8, 40, 512),
    ("qwen3-0.6b", 4 * M, 8, 80, 1000),
    ("qwen3-0.6b", 4 * M, 4, 141, 512),
    ("qwen3-8b", 1 * M, 8, 80, 2000),
    ("qwen3-8b", 1 * M, 8, 80, 512),
    ("qwen3-8b", 1 * M, 4, 80, 1000),
    ("qwen3-8b", 1 * M, 8, 40, 512),
    ("qwen3-8b", 4 * M, 8, 141, 2000),
    ("qwen3-8b", 4 * M, 8, 141, 1000),
    ("qwen3-32b", 1 * M, 8, 80, 2000),
    ("qwen3-32b", 1 * M, 4, 141, 2000),
    ("qwen3-0.6b", 1 * M, 4, 40, 1000),
]


def _plan(config, seq_len, layout: StepLayout, **kw):
    p = plan(
        config,
        seq_len,
        cpu_offload=layout.cpu_offload,
        placements=layout.placements(config.num_hidden_layers),
        **kw,
    )
    return p, project(p).step_s


def test_a_layout_keeps_its_top_layers_on_the_device():
    L = 6
    assert StepLayout(False, 1, 1, L - 1).placements(L) == tuple(
        default_placements(L, save_attention=True)
    )
    assert StepLayout(False, 0, 0, 0).placements(L) == tuple(default_placements(L))
    mixed = StepLayout(False, 2, 1, 3).placements(L)
    assert [(p.input, p.attention) for p in mixed] == [
        ("host", "recompute"),
        ("host", "recompute"),
        ("host", "host"),
        ("host", "host"),
        ("device", "host"),
        ("device", "device"),
    ]


def test_more_device_inputs_lower_the_host_and_raise_the_gpu():
    """The property the brute force leans on, on every split of a 28-layer model's layouts with
    18 layers keeping attention, each over every number of device inputs."""
    c = load_config("qwen3-0.6b")
    kw = dict(gpus=8, sp=8, gpu_mem_gb=80, host_mem_gb=1000)
    for cpu in (False, True):
        for a in (1, 6, 18):
            runs = [_plan(c, 4 * M, StepLayout(cpu, m, a, 18 - a), **kw)[0] for m in range(1, 29)]
            hosts = [p.host.per_node for p in runs]
            gpus = [p.total for p in runs]
            assert hosts == sorted(hosts, reverse=True) and gpus == sorted(gpus), (cpu, a)
            assert hosts[0] > hosts[-1] and gpus[0] < gpus[-1]


def _fewest_inputs_fitting_host(config, seq_len, cpu, k, a, least, kw):
    """The fewest device inputs (from `least`) whose host memory fits, by bisection; None if even
    every input on the device does not."""
    L = config.num_hidden_layers
    if not _plan(config, seq_len, StepLayout(cpu, L, a, k - a), **kw)[0].fits_host:
        return None
    lo, hi = least - 1, L  # hi fits the host, lo does not (or is below the range)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _plan(config, seq_len, StepLayout(cpu, mid, a, k - a), **kw)[0].fits_host:
            hi = mid
        else:
            lo = mid
    return hi


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_chosen_layout_fits_and_none_faster_does(case):
    name, seq_len, gpus, gpu_gb, host_gb = case
    c = load_config(name)
    L = c.num_hidden_layers
    kw = dict(gpus=gpus, sp=gpus, gpu_mem_gb=gpu_gb, host_mem_gb=host_gb)
    choice = choose_layout(c, seq_len, **kw)
    assert choice.chosen is not None, case
    chosen = choice.chosen
    assert chosen.plan.fits and chosen.plan.seq_len == seq_len
    print(f"{case}: {chosen.describe()}")
    checked = 0
    for cpu in (False, True):
        for k in range(L + 1):
            for a in range(1, k + 1) if k else [0]:
                least = 1 if k else 0  # a kept attention keeps the last layer's on the device
                _, t = _plan(c, seq_len, StepLayout(cpu, least, a, k - a), **kw)
                if t >= chosen.step_s * (1 - 1e-9):
                    continue  # the step time does not depend on the inputs at these shapes
                m = _fewest_inputs_fitting_host(c, seq_len, cpu, k, a, least, kw)
                checked += 1
                if m is None:
                    continue
                p, t = _plan(c, seq_len, StepLayout(cpu, m, a, k - a), **kw)
                assert not (p.fits and t < chosen.step_s * (1 - 1e-9)), (case, cpu, k, a, m)
    print(f"  {checked} faster splits checked, none fits")


def test_flags_pin_their_part_and_the_rest_is_still_chosen():
    """At 512 GB of host the free choice keeps every attention and moves inputs to the GPU; each
    pin holds in the layout chosen under it, which still fits."""
    c = load_config("qwen3-8b")
    kw = dict(gpus=8, sp=8, gpu_mem_gb=80, host_mem_gb=512)
    free = choose_layout(c, M, **kw).chosen.plan
    assert free.recomputed_layers == 0 and not free.options.cpu_offload
    for pins, holds in (
        (Pins(cpu_offload=True), lambda p: p.options.cpu_offload),
        (Pins(save_attention=False), lambda p: p.recomputed_layers == 36),
        (Pins(save_attention=True), lambda p: p.recomputed_layers == 0),
        (Pins(offload=False), lambda p: all(x.input == "device" for x in p.placements)),
    ):
        choice = choose_layout(c, M, pins=pins, **kw)
        assert choice.chosen is not None and choice.chosen.plan.fits, pins
        assert holds(choice.chosen.plan), (pins, choice.chosen.describe())
        assert choice.chosen.step_s >= choose_layout(c, M, **kw).chosen.step_s * (1 - 1e-9)


def test_a_hybrid_keeps_attention_on_its_attention_layers_only():
    """Qwen3.5-9B at 1M tokens with 290 GB of host per node: the chooser keeps attention on the
    8 full-attention layers, split between the host and the GPU (from the top among them), and
    on no Gated DeltaNet layer, which has none; the pool's host memory for attention is theirs
    alone; and no faster split of those 8 layers fits (brute force, as above)."""
    c = load_config("qwen3.5-9b")
    attending = [i for i in range(c.num_hidden_layers) if not c.is_linear_layer(i)]
    kw = dict(gpus=8, sp=8, gpu_mem_gb=80, host_mem_gb=290)
    chosen = choose_layout(c, M, **kw).chosen
    assert chosen is not None and chosen.plan.fits
    kept = [i for i, x in enumerate(chosen.plan.placements) if x.attention != "recompute"]
    assert kept and set(kept) <= set(attending), kept
    assert kept == attending[-len(kept) :]  # the top ones
    assert 0 < sum(x.attention == "device" for x in chosen.plan.placements) < len(kept)
    per_layer = chosen.plan.host.saved_attention_per_gpu // sum(
        x.attention == "host" for x in chosen.plan.placements
    )
    every = plan(c, M, save_attention=True, **kw)
    assert every.host.saved_attention_per_gpu == (len(attending) - 1) * per_layer
    for cpu in (False, True):
        for k in range(len(attending) + 1):
            for a in range(1, k + 1) if k else [0]:
                for m in range(1 if k else 0, c.num_hidden_layers + 1):
                    layout = StepLayout(cpu, m, a, k - a)
                    q = plan(
                        c,
                        M,
                        cpu_offload=cpu,
                        placements=layout.placements(c.num_hidden_layers, attending),
                        **kw,
                    )
                    if q.fits:
                        assert project(q).step_s >= chosen.step_s * (1 - 1e-9), (cpu, k, a, m)
                        break  # more device inputs only raise the GPU's peak


def _build_order(rank, world) -> list:
    """run/build.py's build_model on one gloo rank, recording its plans, the probe and the
    reserve in the order they come (each patched to record, the probe choosing cpu_flash)."""
    import dataclasses

    import torch

    import train
    from model.attention import BackendChoice
    from model.parallel import build_mesh
    from run import build

    seen = []
    plan_for_run = build.plan_for_run

    def recording(cfg, *args, **kwargs):
        seen.append(("plan", cfg.attn_backend))
        return plan_for_run(cfg, *args, **kwargs)

    def probe(cfg, mc, sp, device, dtype):
        seen.append(("probe", cfg.attn_backend))
        return dataclasses.replace(cfg, attn_backend="cpu_flash"), BackendChoice("cpu_flash")

    build.plan_for_run, build.choose_attention = recording, probe
    build.reserve_host_blocks = lambda *args, **kwargs: seen.append(("reserve", None))
    cfg = train.TrainConfig(seq_len=64, offload_min_bytes=0)
    mesh = build_mesh(world, 1, "cpu")
    build.build_model(cfg, CFG, None, mesh, 1, torch.device("cpu"), torch.float32)
    return seen


def test_the_layout_is_planned_again_with_the_kernel_the_probe_chose():
    """run/build.py plans the layout, builds the model, lets the probe choose its kernel, then
    plans again with that kernel before the pool reserves a block (flash's backward needs more
    than cuDNN's)."""
    (seen,) = run_distributed(_build_order, 1)
    assert seen == [("plan", "auto"), ("probe", "auto"), ("plan", "cpu_flash"), ("reserve", None)]


def test_the_recipe_and_qwen3_32b_in_the_dry_run():
    """The dry run's own choice: the recipe at 2 TB keeps what it kept (attention once with its
    inputs and attention on the host, 283 s), at 512 GB it still keeps every attention (some
    inputs on the GPU) under 290 s; Qwen3-32B at 1M fits 80 GB and 2 TB under 1,100 s."""
    from dist_utils import run_train as run

    def layout_line(*flags):
        p = run(1, "--preset", "qwen3-8b-1m", "--dry-run", *flags)
        line = next(x for x in p.stdout.splitlines() if x.startswith("layout ("))
        return line, float(line.split(" s projected")[0].rsplit(" ", 1)[1])

    line, t = layout_line()
    assert "inputs 35 host, 1 device; attention 35 host, 1 device; fp32 state on the GPU" in line
    assert t == pytest.approx(283, abs=1)
    line, t512 = layout_line("--host-mem-gb", "512")
    assert "recomputed" not in line and t512 < 290 and t512 == t
    line, t32 = layout_line("--model", "qwen3-32b")
    assert t32 < 1100 and "GB host per node" in line
    gb = float(line.split(" GB per GPU")[0].rsplit(" ", 1)[1])
    assert gb <= 80


# ---- through train.py on CPU: a device budget between the all-device and all-host plans -------
CFG = replace(TRAIN_CFG, num_hidden_layers=4)  # four layers: room for a mixed layout
SEQ = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("layouts")
    ref = hf_model(CFG, seed=3)
    save_hf(ref, str(d / "model"))
    rows = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(4, SEQ + 1))
    np.save(d / "tokens.npy", rows.astype(np.int64))
    return d, ref, rows


def _flags(d, out, *more):
    return [
        "--model",
        str(d / "model"),
        "--data",
        f"tokens:{d / 'tokens.npy'}",
        "--seq-len",
        str(SEQ),
        "--steps",
        "1",
        "--dtype",
        "float32",
        "--tile-mlp",
        "0",
        "--loss-chunk",
        "16",
        "--offload-min-bytes",
        "0",
        "--measure-memory",
        "--eval-every",
        "0",
        "--no-save-final",
        "--out",
        str(out),
        *more,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_budget_between_the_extremes_gets_a_mixed_layout_that_holds(model_dir, nproc):
    """--gpu-mem-gb on CPU budgets the bytes the meter counts: between the all-host plan's peak
    and the all-device one's the chooser mixes, the measured peak stays under the budget, and the
    step is transformers' (loss and grad norm within 1e-6)."""
    from memory.choices import plan_for_run

    d, ref, rows = model_dir

    class Run:  # what plan_for_run reads of a TrainConfig
        seq_len, offload_min_bytes, tile_mlp, loss_chunk, model = SEQ, 0, 0, 16, "test"
        gpu_mem_gb, host_mem_gb, offload, layout = 80.0, 0.0, True, "auto"

    def peak(**pins):
        run = Run()
        run.__dict__.update(pins)
        return plan_for_run(run, CFG, nproc, nproc, 1, 4, "cpu").total

    low = peak(save_attention=False)  # every input on the host, attention recomputed
    high = peak(offload=False, save_attention=True)  # everything on the device
    budget = (low + 2 * high) / 3 / 1e9
    out = d / f"mixed{nproc}"
    run_train(nproc, *_flags(d, out, "--sp", str(nproc), "--gpu-mem-gb", f"{budget:.9f}"))
    _, placements = read_layout(str(out / "layout.json"), CFG.num_hidden_layers)
    kinds = {(x.input, x.attention) for x in placements}
    assert len({x.input for x in placements}) == 2 or len({x.attention for x in placements}) > 1
    assert len(kinds) > 1, kinds
    with open(out / "metrics.jsonl") as f:
        record = next(r for r in map(json.loads, f) if not r.get("eval"))
    assert record["peak_mem_gb"] <= budget, (record["peak_mem_gb"], budget)
    # and honoured: the meter sees the plan of that layout (the default one measures 3% more)
    planned = record["planned_peak_gb"]
    assert abs(record["peak_mem_gb"] / planned - 1) <= 0.01, (record["peak_mem_gb"], planned)
    loss, norm = ref_loss_and_norm(ref, rows[:1])[:2]
    print(
        f"{nproc} processes, budget {budget * 1e3:.3f} MB, measured "
        f"{record['peak_mem_gb'] * 1e3:.3f} MB, planned {planned * 1e3:.3f} MB: {sorted(kinds)}"
    )
    assert math.isclose(record["loss"], loss, rel_tol=1e-6)
    assert math.isclose(record["grad_norm"], norm, rel_tol=1e-6)


@pytest.mark.slow
def test_a_layout_file_repeats_a_run_and_wrong_ones_are_refused(model_dir, tmp_path):
    d, _, _ = model_dir
    first = tmp_path / "first"
    run_train(2, *_flags(d, first, "--sp", "2"))
    saved = first / "layout.json"
    again = tmp_path / "again"
    p = run_train(2, *_flags(d, again, "--sp", "2", "--layout", str(saved)))
    assert f"(--layout {saved})" in p.stdout
    assert (
        json.loads(saved.read_text())["layers"]
        == json.loads((again / "layout.json").read_text())["layers"]
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(saved.read_text()), "layers": [{"input": "gpu"}]}))
    for flags, says in (
        (["--layout", str(bad)], f"--layout {bad}: not a layout file"),
        (["--layout", str(tmp_path / "none.json")], "no such file"),
        (["--layout", str(saved), "--cpu-offload"], "drop --cpu-offload"),
    ):
        r = run_train(1, *_flags(d, tmp_path / "x", *flags), check=False)
        assert r.returncode == 2 and says in r.stderr, (flags, r.stderr[-500:])
        assert len(r.stderr.strip().splitlines()) == 1
