"""The planner predicts the meter, and the rehearsal measures what the meter measures, on a CPU
matrix.

Each configuration runs two steps of train.train_step (three on the REHEARSED ones) on the real
pieces (FSDP2 over gloo, Ulysses attention, checkpoint-with-offload, tiled MLP, the chunked loss,
AdamW) in 1-4 processes, measured with memory/meter.py on every rank, where torch's CPU attention
kernels return zeros of their real shapes without the arithmetic (tests/attention_shapes_only.py:
the meter counts what an operator returns, not what it computes; the arithmetic was 3/4 of the
time). The largest rank's peak at step 2 (the first step with AdamW's states: the steady state) is
compared with memory/plan.py for the same configuration, within 5%. The same steps on fake tensors,
as train.py --rehearse runs them (a fake process group, this process as rank 0, nothing computed),
must count what the real steps count, within 1%, on the layouts named in REHEARSED (every kind of
piece). Steps 2 and 3 must measure the same to the byte, on a quiet machine and on a busy one.

Rows are long and hidden sizes small, so that activations, not parameters, make the peak.
Configurations marked "mixed" give each layer its own placement (memory/layouts.py's layouts):
inputs on the host and the device, attention on the host, the device or recomputed.
Configurations marked "save attention" run attention once (apply_offload(save_attention=True)):
L-1 layers' attention out and lse go to the pool's host blocks, the last layer's stay on the
device; each is paired with the same configuration without it, whose peak it must not exceed by
more than the planner's 5% bar.

    python tests/test_memory_matrix.py        # the table, worst case last
"""

import os
import sys
import time
from dataclasses import asdict, replace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from attention_shapes_only import attention_shapes_only  # noqa: E402
from dist_utils import run_distributed  # noqa: E402

from memory.plan import plan  # noqa: E402
from memory.rehearsal import HostReads  # noqa: E402
from model.checkpoint_offload import LayerPlacement  # noqa: E402
from model.config import Qwen3Config  # noqa: E402
from model.lora import LoraSpec  # noqa: E402
from model.qwen3 import RMSNORM_CHUNK_ELEMS  # noqa: E402

TINY = replace(Qwen3Config.preset("tiny"), max_position_embeddings=1 << 16)  # GQA 2, head_dim 32
ODD = replace(
    TINY,
    hidden_size=80,
    intermediate_size=176,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=24,
    vocab_size=333,
)  # not powers of two; 3 query heads per kv head
TIED = replace(TINY, tie_word_embeddings=True)
# the tied V x H in fp32 (2.1 MB) is an eighth of the step: the root holds the gathered weight
# and the loss's gradient of it through every layer's backward; 8,191 rows pad to 8,192 over 2
TIED_VOCAB = replace(TIED, vocab_size=8191)
# Qwen3-8B's proportions: intermediate 3 x hidden, heads x head_dim = hidden, 4 q heads per kv head
LIKE_8B = replace(
    TINY,
    hidden_size=128,
    intermediate_size=384,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
)
# parameters a third of the peak: gathered layers, their gradients and the fp32 state count
WIDE = replace(
    TINY,
    hidden_size=256,
    intermediate_size=768,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=2048,
)
DEEP = replace(TINY, num_hidden_layers=4)
LOSSY = replace(LIKE_8B, vocab_size=4096)  # the loss phase makes the peak
# attention once: three layers' attention on the host, one on the device
SAVE = {"save_attention": True}
# FSDP2 CPU offload: fp32 shards, gradients, AdamW states on the host
CPU_OFF = {"cpu_offload": True}
# LoRA (model/lora.py): every linear layer adapted, the base frozen; with the norms and the
# embedding training too (layer 0's input then needs grad and goes to the host)
LORA = {"lora": LoraSpec(rank=8)}
LORA_TRAIN = {"lora": LoraSpec(rank=8, train=("norm", "embed_tokens"))}


def layers(*where: str) -> dict:
    """A mixed layout, one "input/attention" per layer from layer 0 (memory/layouts.py chooses
    such ones): each layer's input on the host or the device, its attention on either or
    recomputed."""
    return {"placements": tuple(tuple(w.split("/")) for w in where)}


# every kind at once: inputs on both, attention on the host, the device and recomputed
MIXED = layers("host/recompute", "host/host", "device/host", "device/device")
DEEP_8B = replace(LIKE_8B, num_hidden_layers=4)
# a mixture of experts (model/moe.py): 8 experts, top 2, Qwen3-30B-A3B's expert width / hidden
MOE = replace(
    LIKE_8B, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True
)

# Qwen3.5 (model/qwen3_5.py): 3 Gated DeltaNet layers and 1 gated attention layer, 4 key heads
# of the delta rule to 8 value heads of 16, its working sets by far the largest tensors of a layer;
# untied, as Qwen3.5-9B and larger are (the tied layouts above are held to 1% for the tied
# embedding's terms; the delta rule's block working set here is fitted within 2%)
QWEN35 = replace(
    Qwen3Config.preset("qwen3.5-tiny"), max_position_embeddings=1 << 16, tie_word_embeddings=False
)
# ... and its mixture of experts: every layer sparse, 8 experts of 32, top 2, a shared expert of 48
QWEN35_MOE = replace(Qwen3Config.preset("qwen3.5-moe-tiny"), max_position_embeddings=1 << 16)

# name: (config, world, sp, seq_len, dtype, offload, mlp tile (0: untiled), loss chunk
#        [, RMSNorm chunk][, SAVE])
MATRIX = {
    "sp1": (TINY, 1, 1, 4096, "float32", True, 0, 256),
    "sp1 bf16 tiled": (TINY, 1, 1, 2048, "bfloat16", True, 512, 256),
    "sp2": (TINY, 2, 2, 4096, "float32", True, 0, 256),
    "sp2 tied": (TIED, 2, 2, 4096, "float32", True, 512, 256),
    # 64-row loss chunks keep the loss's [chunk, V] buffers under a layer's backward
    "sp2 tied large vocab": (TIED_VOCAB, 2, 2, 2048, "float32", True, 0, 64),
    "sp2 odd sizes": (ODD, 2, 2, 4096, "float32", True, 0, 256),
    "sp2 bf16 norm chunks": (TINY, 2, 2, 4096, "bfloat16", True, 0, 256, 1 << 14),
    "sp4 kv repeat tiled": (TINY, 4, 4, 8192, "float32", True, 1024, 256),
    "dp2 x sp2 no offload tiled": (TINY, 4, 2, 4096, "float32", False, 512, 256),
    "sp2 8B-like tiled": (LIKE_8B, 2, 2, 4096, "float32", True, 256, 128),
    "sp2 wide params": (WIDE, 2, 2, 1024, "float32", True, 0, 256),
    "sp1 save attention": (TINY, 1, 1, 4096, "float32", True, 0, 256, SAVE),
    "sp2 4 layers": (DEEP, 2, 2, 4096, "float32", True, 0, 256),
    "sp2 4 layers save attention": (DEEP, 2, 2, 4096, "float32", True, 0, 256, SAVE),
    "sp2 8B-like tiled save attention": (LIKE_8B, 2, 2, 4096, "float32", True, 256, 128, SAVE),
    "sp2 4 layers no offload save attention": (
        DEEP,
        2,
        2,
        4096,
        "float32",
        False,
        0,
        256,
        SAVE,
    ),  # all on the device
    "sp2 loss peak": (LOSSY, 2, 2, 4096, "float32", True, 256, 512),
    "sp2 loss peak save attention": (LOSSY, 2, 2, 4096, "float32", True, 256, 512, SAVE),
    "sp1 cpu offload": (TINY, 1, 1, 4096, "float32", True, 0, 256, CPU_OFF),
    "sp2 cpu offload": (TINY, 2, 2, 4096, "float32", True, 0, 256, CPU_OFF),
    "sp2 wide params cpu offload": (WIDE, 2, 2, 1024, "float32", True, 0, 256, CPU_OFF),
    "sp2 8B-like tiled save attention cpu offload": (
        LIKE_8B,
        2,
        2,
        4096,
        "float32",
        True,
        256,
        128,
        {**SAVE, **CPU_OFF},
    ),
    "sp2 4 layers mixed": (DEEP, 2, 2, 4096, "float32", True, 0, 256, MIXED),
    "sp2 lora": (TINY, 2, 2, 4096, "float32", True, 0, 256, LORA),
    "sp2 8B-like tiled lora train": (LIKE_8B, 2, 2, 4096, "float32", True, 256, 128, LORA_TRAIN),
    "sp2 8B-like tiled mixed": (
        DEEP_8B,
        2,
        2,
        4096,
        "float32",
        True,
        256,
        128,
        layers("device/recompute", "host/device", "host/host", "device/device"),
    ),
    "sp2 moe tiled": (MOE, 2, 2, 4096, "float32", True, 1024, 128),
    "dp2 x sp2 moe save attention cpu offload": (
        MOE,
        4,
        2,
        4096,
        "float32",
        True,
        0,
        128,
        {**SAVE, **CPU_OFF},
    ),
    "dp2 x sp2 4 layers mixed cpu offload": (
        DEEP,
        4,
        2,
        4096,
        "float32",
        True,
        0,
        256,
        {**MIXED, **CPU_OFF},
    ),
    "qwen3.5 sp1": (QWEN35, 1, 1, 4096, "float32", True, 0, 256),
    # attention once: the one attention layer (the last) keeps its own on the device
    "qwen3.5 sp2 save attention": (QWEN35, 2, 2, 4096, "float32", True, 0, 256, SAVE),
    "qwen3.5 sp2 bf16 tiled cpu offload": (
        QWEN35,
        2,
        2,
        4096,
        "bfloat16",
        True,
        512,
        256,
        {**SAVE, **CPU_OFF},
    ),
    "qwen3.5 moe sp2": (QWEN35_MOE, 2, 2, 4096, "float32", True, 1024, 128),
}
# The layouts also rehearsed on fake tensors: every kind of piece once (tied, odd sizes, bf16
# norm chunks, 2 and 4 processes, a dp group, no offload, attention once, the loss's peak, CPU
# offload, mixed placements, LoRA, MoE, Qwen3.5's Gated DeltaNet layers and shared expert; one
# process: tests/test_rehearsal.py's "sp1"). A rehearsal costs more than the real steps here
# (3.4 s against 2.2 s a layout on 2 cores: fake tensors pay per operation, and the shapes are
# small), so the other 20 layouts, made of the same pieces, are left to the real steps.
REHEARSED = (
    "sp2 tied large vocab",
    "sp2 odd sizes",
    "sp2 bf16 norm chunks",
    "sp4 kv repeat tiled",
    "dp2 x sp2 no offload tiled",
    "sp2 loss peak save attention",
    "sp2 8B-like tiled save attention cpu offload",
    "sp2 8B-like tiled lora train",
    "sp2 moe tiled",
    "dp2 x sp2 moe save attention cpu offload",
    "dp2 x sp2 4 layers mixed cpu offload",
    "qwen3.5 sp2 save attention",
    "qwen3.5 moe sp2",
)
# attention once -> the same configuration recomputing attention; the peak in a layer's backward
# (as at the recipe: 20.8 GB there against 10.8 + 2.1 GB in the loss phase)
PAIRS = {
    "sp1 save attention": "sp1",
    "sp2 4 layers save attention": "sp2 4 layers",
    "sp2 8B-like tiled save attention": "sp2 8B-like tiled",
}
LOSS_PAIRS = {"sp2 loss peak save attention": "sp2 loss peak"}  # the peak in the loss phase
# CPU offload -> the same configuration with the fp32 state on the device
CPU_PAIRS = {
    "sp1 cpu offload": "sp1",
    "sp2 cpu offload": "sp2",
    "sp2 wide params cpu offload": "sp2 wide params",
    "sp2 8B-like tiled save attention cpu offload": "sp2 8B-like tiled save attention",
}


def _steps(rank, world, specs, rehearse=False):
    """Steps of train.train_step per spec on this rank (as many as its last field); returns each
    spec's measured peak of each step (bytes), and the offload pool's pinned host bytes and
    device-to-host bytes of a step.
    rehearse=True: two steps, as train.py --rehearse runs them: on fake tensors, as rank 0 of a
    fake process group the caller has set up."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    import train
    from memory.meter import StepMeter
    from model.checkpoint_offload import LayerPlacement, apply_offload
    from model.parallel import build_mesh, build_sharded_model
    from model.qwen3 import _RMSNormFn
    from model.ulysses import UlyssesAttention, UlyssesLinearMix
    from model.ulysses_exchange import shard_row

    if not rehearse:
        attention_shapes_only()
    out = []
    for spec in specs:
        cfg_dict, sp, seq_len, dtype, offload, tile, chunk, norm_chunk, save, cpu_off = spec[:10]
        where, lora, steps = spec[10:]
        cfg, dtype = Qwen3Config(**cfg_dict), getattr(torch, dtype)
        _RMSNormFn.CHUNK_ELEMS = norm_chunk
        torch.manual_seed(0)
        mesh = build_mesh(world, sp, "cpu")  # outside the fake mode, as train.py --rehearse does
        mode = FakeTensorMode(allow_non_fake_inputs=True) if rehearse else None
        model, _ = build_sharded_model(
            cfg,
            mesh,
            device="cpu",
            param_dtype=dtype,
            progress=False,
            cpu_offload=cpu_off,
            fake_mode=mode,
            lora=lora,
        )
        model.set_attention(UlyssesAttention(mesh["sp"].get_group()))
        if cfg.hybrid:  # the Gated DeltaNet layers' exchange, as run/build.py installs it
            model.set_linear_mix(UlyssesLinearMix(mesh["sp"].get_group()))
        if where:  # a mixed layout: the placements say it all
            placements = [LayerPlacement(*w) for w in where]
            pool = apply_offload(model, min_bytes=0, tile_mlp=tile or None, placements=placements)
        else:
            pool = apply_offload(
                model, offload=offload, min_bytes=0, tile_mlp=tile or None, save_attention=save
            )
        step_cfg = train.TrainConfig(cpu_offload=cpu_off, loss_chunk=chunk, rehearse=rehearse)
        opt = train.make_optimizer(step_cfg, model)
        peaks = []
        with mode or contextlib.nullcontext():
            g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
            batch = shard_row(
                torch.randint(0, cfg.vocab_size, (seq_len + 1,), generator=g),
                mesh["sp"].get_local_rank(),
                sp,
            )
            for _ in range(2 if rehearse else steps):
                meter = StepMeter(
                    "cpu",
                    model=model,
                    optimizer=opt,
                    baseline=list(batch.values()),
                    host=pool,
                    host_state=cpu_off,
                )
                # on fake tensors the step's host reads are answered below the meter, as
                # --rehearse answers them (memory/rehearsal.py's HostReads)
                with HostReads() if rehearse else contextlib.nullcontext():
                    meter.start()
                    train.train_step(model, opt, [batch], step_cfg)
                    meter.stop()
                peaks.append(meter.peak_bytes)
                moved = pool.reset_step()
        out.append({"peaks": peaks, "pinned": moved.pinned_bytes, "d2h": moved.d2h_bytes})
        del model, opt, pool
    _RMSNormFn.CHUNK_ELEMS = RMSNORM_CHUNK_ELEMS
    return out


def _spec(name):
    """(config, world, sp, seq_len, dtype, offload, tile, loss chunk, norm chunk, save_attention,
    cpu_offload, placements or None, LoraSpec or None)."""
    s = MATRIX[name]
    extra = s[8:]
    flags = extra[-1] if extra and isinstance(extra[-1], dict) else {}
    nc = next((e for e in extra if isinstance(e, int)), RMSNORM_CHUNK_ELEMS)
    save, cpu_off = bool(flags.get("save_attention")), bool(flags.get("cpu_offload"))
    return (*s[:8], nc, save, cpu_off, flags.get("placements"), flags.get("lora"))


def _plan(name):
    """memory/plan.py's plan of a matrix layout, for the CPU path the matrix measures."""
    c, world, sp, T, dt, off, tile, ch, nc, sa, co, where, lora = _spec(name)
    given = {"placements": tuple(LayerPlacement(*w) for w in where)} if where else {}
    return plan(
        c,
        T,
        gpus=world,
        sp=sp,
        offload=off,
        tiled_mlp=tile > 0,
        mlp_tile=tile or None,
        loss_chunk=ch,
        compute_bytes=torch.finfo(getattr(torch, dt)).bits // 8,
        device="cpu",
        norm_chunk=nc,
        save_attention=sa,
        cpu_offload=co,
        lora=lora,
        **given,
    )


def _rehearse(world: int, specs) -> list:
    """_steps on fake tensors, this process as rank 0 of a fake process group of `world`."""
    from memory.rehearsal import ask_real_kernels, fake_process_group

    ask_real_kernels(torch.device("cpu"))  # before any fake tensor, as --rehearse does
    with fake_process_group(world):
        return _steps(0, world, specs, rehearse=True)


def measure(names=None, pool=None, steps=None, rehearsed=None) -> dict:
    """{name: (measured, planned)} for the matrix, one group of processes per world size; measured
    is step 2, the first steady-state step (AdamW's states exist from step 1 on). Given dicts are
    filled: `pool` with {name: ((pinned, d2h) of the largest rank, (planned pinned, planned
    d2h))}, `steps` with {name: the largest rank's peak of each of its steps}, `rehearsed`
    with {name: the first two steps' peaks on fake tensors} for the REHEARSED names."""
    names = names or list(MATRIX)
    res = {}
    for world in sorted({MATRIX[n][1] for n in names}):
        group = [n for n in names if MATRIX[n][1] == world]
        # the REHEARSED layouts run a third step, for the steady-state check
        counts = [3 if n in REHEARSED else 2 for n in group]
        specs = [(asdict(s[0]), *s[2:], k) for s, k in zip(map(_spec, group), counts, strict=True)]
        ranks = run_distributed(_steps, world, specs, timeout=600)
        to_rehearse = [k for k, n in enumerate(group) if n in REHEARSED]
        if rehearsed is not None and to_rehearse:
            fake = _rehearse(world, [specs[k] for k in to_rehearse])
            for k, peaks in zip(to_rehearse, fake, strict=True):
                rehearsed[group[k]] = peaks["peaks"]
        for k, n in enumerate(group):
            p = _plan(n)
            per_step = [max(step) for step in zip(*(r[k]["peaks"] for r in ranks), strict=True)]
            res[n] = (per_step[1], p.total)
            if steps is not None:
                steps[n] = per_step
            if pool is not None:
                pool[n] = (
                    max((r[k]["pinned"], r[k]["d2h"]) for r in ranks),
                    (
                        p.host.saved_inputs_per_gpu + p.host.saved_attention_per_gpu,
                        p.host.offload_bytes_per_step // 2,
                    ),
                )
    return res


_POOL: dict = {}
_STEPS: dict = {}
_REHEARSED: dict = {}


@pytest.fixture(scope="module")
def matrix():
    return measure(pool=_POOL, steps=_STEPS, rehearsed=_REHEARSED)


@pytest.mark.slow
def test_planned_peak_within_5_percent_of_measured(matrix):
    res = matrix
    worst = max(res, key=lambda n: abs(res[n][0] / res[n][1] - 1))
    for n, (m, p) in res.items():
        print(f"{n:28} measured {m / 1e6:8.3f} MB  planned {p / 1e6:8.3f} MB  ratio {m / p:.4f}")
    m, p = res[worst]
    print(f"worst: {worst}: measured / planned = {m / p:.4f}")
    assert all(abs(m / p - 1) <= 0.05 for m, p in res.values()), res


def assert_planned_within_1_percent_at_both_steps(name: str) -> None:
    """Steps 1 (no AdamW states yet) and 2 of a matrix layout within 1% of its plan."""
    p = _plan(name)
    planned = (p.first_step_total, p.total)
    print(f"{name:40} steps 1, 2 measured {_STEPS[name][:2]} planned {list(planned)}")
    for m, want in zip(_STEPS[name][:2], planned, strict=True):
        assert abs(m / want - 1) <= 0.01, (name, _STEPS[name][:2], planned)


@pytest.mark.slow
def test_tied_layouts_planned_within_1_percent_at_both_steps(matrix):
    """A tied embedding is gathered in the root unit for the whole step, and the loss's gradient
    of it stays until the root's reduce-scatter, after the embedding's backward: both are V x H.
    On every tied layout, step 1 (no AdamW states yet) and step 2 plan within 1% of the meter;
    in "sp2 tied large vocab" V x H in fp32 is over a tenth of the step, so leaving either out
    of the layers' backward lands far outside."""
    tied = [n for n in matrix if MATRIX[n][0].tie_word_embeddings]
    c = MATRIX["sp2 tied large vocab"][0]
    assert c.vocab_size * c.hidden_size * 4 >= 0.1 * _STEPS["sp2 tied large vocab"][1]
    for n in tied:
        assert_planned_within_1_percent_at_both_steps(n)


@pytest.mark.slow
def test_mixed_layouts_planned_within_1_percent_at_both_steps(matrix):
    """Each layer placed its own way: the planner counts a layer's device-kept tensors until its
    backward frees them, and its host ones in the pool (to the byte: pinned and copied). Within
    1% at steps 1 and 2; leaving out the attention kept on the device by the layers below the
    one in backward lands 4% off in "sp2 8B-like tiled mixed"."""
    mixed = [n for n in matrix if "mixed" in n]
    assert len(mixed) == 3
    for n in mixed:
        assert_planned_within_1_percent_at_both_steps(n)
        assert _POOL[n][0] == _POOL[n][1], (n, _POOL[n])


@pytest.mark.slow
def test_the_rehearsal_measures_what_the_meter_measures(matrix):
    """The same steps on fake tensors (train.py --rehearse's way: a fake process group, this
    process as rank 0, nothing computed) count what the real steps count, on every REHEARSED
    layout and both steps, within 1% (same code, same meter: to the byte where nothing differs by
    rank)."""
    assert sorted(_REHEARSED) == sorted(REHEARSED)
    for n in REHEARSED:
        real, fake = _STEPS[n][:2], _REHEARSED[n]
        print(f"{n:46} measured {real}  rehearsed {fake}")
        assert all(abs(f / r - 1) <= 0.01 for f, r in zip(fake, real, strict=True)), (n, real, fake)


@pytest.mark.slow
def test_steady_state_steps_measure_the_same(matrix):
    """Steps 2 and 3 hold the same tensors at the same moments: the meter gives both the same
    peak, to the byte (it waits for gloo's worker thread at every collective), on every REHEARSED
    layout (every kind of piece; the others run two steps)."""
    for n in REHEARSED:
        assert _STEPS[n][1] == _STEPS[n][2], (n, _STEPS[n])


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.slow
def test_a_busy_machine_measures_the_same(matrix):
    """With both cores kept busy by two other processes, the layout most sensitive to a late free
    (sp2 loss peak save attention: all-to-all buffers live at its peak) measures what it measured
    on a quiet machine, to the byte, in both steady-state steps. (Step 1 also makes what a
    process makes once, which depends on the layouts run before it in the same process.)"""
    import multiprocessing as mp

    name = "sp2 loss peak save attention"
    busy = [mp.get_context("spawn").Process(target=_spin, args=(600,)) for _ in range(2)]
    for p in busy:
        p.start()
    try:
        loaded: dict = {}
        measure([name], steps=loaded)
    finally:
        for p in busy:
            p.kill()
    assert loaded[name][1:] == _STEPS[name][1:], (loaded[name], _STEPS[name])


def _one_layers_attention(name):
    """Bytes of one layer's attention out [T, nh/sp, hd] and fp32 lse [nh/sp, T] on one rank."""
    c, _, sp, T, dtype = MATRIX[name][:5]
    t, b = T // sp, torch.finfo(getattr(torch, dtype)).bits // 8
    return t * c.num_attention_heads * (c.head_dim * b + 4)


@pytest.mark.slow
def test_save_attention_peak_rise(matrix):
    """Attention once keeps L-1 layers' out and lse on the host, and the pool fetches one layer's
    back together with its input, one layer ahead: where a layer's backward makes the peak, the
    measured device peak rises by that one layer's out and lse (to 0.5% of the peak). Where the
    loss makes it, the last layer's input, out and lse (kept on the device) raise it. In every pair
    the measured rise equals the planned one (to 0.5% of the peak)."""
    for sa, base in {**PAIRS, **LOSS_PAIRS}.items():
        (m_sa, p_sa), (m, p) = matrix[sa], matrix[base]
        print(
            f"{sa:34} measured {m_sa / 1e6:8.3f} MB, without {m / 1e6:8.3f} MB: rise "
            f"{(m_sa - m) / 1e6:+.3f} MB, planned {(p_sa - p) / 1e6:+.3f} MB"
        )
        assert abs((m_sa - m) - (p_sa - p)) <= 0.005 * m, (sa, m_sa - m, p_sa - p)
        if sa in PAIRS:
            kept = _one_layers_attention(sa)
            assert abs((m_sa - m) - kept) <= 0.005 * m, (sa, m_sa - m, kept)


@pytest.mark.slow
def test_pool_host_bytes_equal_plan(matrix):
    """The offload pool's pinned blocks and the bytes it copied to the host in a step equal the
    planner's, to the byte: every layer's input, or with attention once L-1 layers' input, out and
    lse."""
    for n, (got, want) in _POOL.items():
        assert got == want, (n, got, want)
    assert (
        _POOL["sp1 save attention"][0][0] > _POOL["sp1"][0][0]
    )  # the saved attention really went to the pool


@pytest.mark.slow
def test_cpu_offload_drop_equals_plan(matrix):
    """CPU offload takes the fp32 parameter shards, gradients and AdamW states off the device: the
    measured drop of the peak equals the planned one in every pair, to 2% of the peak (the two
    plans' own errors, each within 1.4% in these pairs, do not cancel exactly)."""
    for co, base in CPU_PAIRS.items():
        (m_co, p_co), (m, p) = matrix[co], matrix[base]
        print(
            f"{co:46} measured {m_co / 1e6:8.3f} MB, without {m / 1e6:8.3f} MB: drop "
            f"{(m - m_co) / 1e6:.3f} MB, planned {(p - p_co) / 1e6:.3f} MB"
        )
        assert abs((m - m_co) - (p - p_co)) <= 0.02 * m, (co, m - m_co, p - p_co)
        assert m - m_co > 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    res = measure(sys.argv[1:] or None, pool=_POOL, steps=_STEPS, rehearsed=_REHEARSED)
    for n, (m, p) in res.items():
        print(
            f"{n:34} measured {m / 1e6:8.3f} MB  planned {p / 1e6:8.3f} MB  ratio {m / p:.4f}  "
            f"pool (pinned, d2h) {_POOL[n][0]} planned {_POOL[n][1]}"
        )
        print(f"{'':34} steps {_STEPS[n]}  rehearsed {_REHEARSED.get(n, '-')}")
    print(f"{time.perf_counter() - t0:.1f} s")
