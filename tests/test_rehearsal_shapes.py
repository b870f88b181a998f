"""The memory planner against the rehearsal of the real step, at real Qwen3 shapes.

    pytest tests/test_rehearsal_shapes.py -s    # 2 layers, marked slow: about 70 s on 2 cores
    pytest tests/test_rehearsal_shapes.py -s --full-depth -k "full and recipe"  # 36 layers

`train.py --rehearse` (memory/rehearsal.py) runs two real steps of a run on fake tensors with a
fake process group of the run's world size and writes OUT/rehearsal.json: the live bytes the CPU
meter counted at each step's peak and the FLOPs of step 1, next to memory/plan.py's figures for
the same run. The planner is arithmetic over the shapes written by hand; the rehearsal is the
code itself running (FSDP2, Ulysses, the offload pool, the chunked loss, AdamW), so each is the
other's reference. For each shape below, within 3% (LoRA's and MoE's within 1%):
  - step 2's peak (AdamW's states exist) against the plan's peak,
  - step 1's peak against the plan's first step (AdamW makes its states after the peak),
  - step 2's peak within the loss phase and within the layers' backward, each against the
    planner's largest moment there,
  - step 1's FLOPs (torch's flop formulas) against memory/model_size.py's step_flops per rank.

Every shape runs on the recipe's preset (qwen3-8b-1m: bf16, YaRN x32, offload, MLP tiles of
16,384 tokens, loss chunks of 256) from a directory holding only a config.json written from
model/config.py's PRESETS. The default versions keep 2 decoder layers (the planner's moments are
those of the last layer, layer 1 and layer 0, and FSDP2's units are all there; depth repeats
them) and larger loss chunks (see DEPTHS); --full-depth runs the real depth (36 layers for 8B,
64 for 32B) at the recipe's own flags, minutes each on a CPU.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from dist_utils import run_train

from model.config import PRESETS

# name: (model preset, WORLD_SIZE of the fake process group, flags on top of the recipe's)
SHAPES = {
    "recipe": ("qwen3-8b", 8, []),
    "32b at 1M": ("qwen3-32b", 8, []),
    "8b at 2M": ("qwen3-8b", 8, ["--seq-len", "2097152"]),
    "8b sp4": ("qwen3-8b", 4, []),
    "8b dp2 x sp4": ("qwen3-8b", 8, ["--sp", "4"]),
    # sp over 2 nodes of 8 (a node is 8 without LOCAL_WORLD_SIZE): 65,536 tokens per rank
    "8b sp16 on 2 nodes": ("qwen3-8b", 16, ["--sp", "16"]),
    "8b cpu offload": ("qwen3-8b", 8, ["--cpu-offload"]),
    # tied: the root unit holds the gathered embedding and the loss's gradient of it (V x H each,
    # 0.31 GB in bf16) through every layer's backward
    "0.6b tied": ("qwen3-0.6b", 8, []),
    # the layout the chooser takes for 32B at 1M (some inputs on the GPU, attention on both, the
    # fp32 state on the host), as a --layout file: at 2 layers one host layer and one GPU layer
    "32b mixed layout": ("qwen3-32b", 8, ["--layout", "{layout}"]),
    # a mixture of experts (128 experts, 8 per token, sharded 16 per rank): its fp32 state
    # needs the host, which the layout chooser finds
    "30b-a3b at 1M": ("qwen3-30b-a3b", 8, []),
    # LoRA (model/lora.py) on every linear layer, the base frozen in bf16: a frozen embedding
    # keeps layer 0's input on the device, the tiled MLP runs the adapters in its tiles
    "8b lora": ("qwen3-8b", 8, ["--lora-rank", "16"]),
    "32b lora": ("qwen3-32b", 8, ["--lora-rank", "16"]),
    # the embedding and every norm train too: their fp32 masters, gradients and AdamW states
    "8b lora embed, norm": ("qwen3-8b", 8, ["--lora-rank", "16", "--lora-train", "embed,norm"]),
    # Qwen3.5 (model/qwen3_5.py): at 2 layers one Gated DeltaNet layer and one gated attention
    # layer (write_config), the delta rule over all 1,048,576 tokens of its heads on each rank
    "qwen3.5-9b at 1M": ("qwen3.5-9b", 8, []),
    # ... and its mixture of experts: 256 experts of 512 and a shared expert in every layer
    "qwen3.5-35b-a3b at 1M": ("qwen3.5-35b-a3b", 8, []),
}
# LoRA's shapes, the mixture of experts' and Qwen3.5's are held to 1%; the others to TOLERANCE
LORA_TOLERANCE = 0.01
# the layers of a "{layout}" file at 2 layers (at full depth, the dry run's own choice)
MIXED_LAYERS = [{"input": "host", "attention": "host"}, {"input": "device", "attention": "device"}]
# depth: (decoder layers, None: the preset's own; flags on top of the shape's). A rehearsal's time
# is mostly the loss's per-chunk ops (the recipe's 256-row chunks: 512 of them per step at 131,072
# tokens per rank). The few-layer versions take chunks of 2,048 rows: measured, every shape's two
# peaks are the same to 6 digits as with 256 (the loss is not the peak), and the six 8B and 32B
# shapes take 80 s instead of 154 s (2 cores, load 2; 4 layers add ~5 s a shape), 0.6B 8 s more.
# Full depth runs the recipe as it is: 117 s for 8B, 332 s for 32B (2 cores, load 3 to 5), 65 s
# for 0.6B (28 layers).
DEPTHS = {
    "few layers": (2, ["--loss-chunk", "2048"]),
    "full depth": (None, []),
}
DEPTH_PARAMS = {
    "few layers": pytest.mark.slow,
    "full depth": pytest.mark.full_depth,
}
# 8B at 2M tokens over sp 8 holds the same 262,144 tokens per rank, in FSDP2 units over the same
# 8 ranks, as dp 2 x sp 4 at 1M: at 2 layers both rehearse to 37.073 GB (and plan to 37.067), so
# the default suite runs the one with a dp group and leaves the other to --full-depth.
SAME_AS_ANOTHER = {("8b at 2M", "few layers")}
# LoRA with the embedding and norms training adds to "8b lora" only the trained tensors' state
# (measured at 2 layers: every check within 0.01%, FLOPs -0.3%); its 35 s run only with
# --full-depth.
# 128 experts' tiles take 45 s to 2 minutes of CPU even at 2 layers (measured: both peaks +0.02%
# against the plan, held to 1% with LoRA's); the MoE layouts of tests/test_memory_matrix.py
# rehearse to the byte in the default suite.
# Four more few-layer shapes run only with --full-depth, each covered in the default suite by
# another that takes the same code path (they passed at 2 layers when moved; together they took
# 57 s of the suite on 2 cores): "8b sp4" by "8b dp2 x sp4" (262,144 tokens per rank
# both, plus a dp group), "32b at 1M" by "32b mixed layout" (32B's shapes, a layout on top),
# "32b lora" by "8b lora" (the same adapters), "8b cpu offload" by "32b mixed layout" (the fp32
# state on the host) and by the CPU-offload layouts of tests/test_memory_matrix.py.
# Qwen3.5's rehearsals run the delta rule's 32 alike blocks at 1M as one (memory/rehearsal.py's
# OneBlockDeltaRule): the 35B-A3B at 2 layers in about a minute on 2 cores.
WITH_FULL_DEPTH = {
    ("8b lora embed, norm", "few layers"),
    ("30b-a3b at 1M", "few layers"),
    ("8b sp4", "few layers"),
    ("32b at 1M", "few layers"),
    ("32b lora", "few layers"),
    ("8b cpu offload", "few layers"),
}
CASES = [
    pytest.param(
        depth,
        shape,
        marks=[mark, pytest.mark.full_depth] if (shape, depth) in WITH_FULL_DEPTH else mark,
        id=f"{depth}-{shape}",
    )
    for depth, mark in DEPTH_PARAMS.items()
    for shape in SHAPES
    if (shape, depth) not in SAME_AS_ANOTHER
]
# check: (rehearsal.json's rehearsed figure, its planned figure), as paths into the record
CHECKS = {
    "step 2 peak": (("peak_bytes", "step2"), ("planned_bytes", "total")),
    "step 1 peak": (("peak_bytes", "step1"), ("planned_bytes", "first_step")),
    "loss phase": (("phase_peak_bytes", "step2", "loss"), ("planned_bytes", "loss")),
    "backward phase": (("phase_peak_bytes", "step2", "backward"), ("planned_bytes", "backward")),
    "flops": (("flops", "rehearsed"), ("flops", "planned")),
}


def at(record: dict, path: tuple):
    for key in path:
        record = record[key]
    return record


TOLERANCE = 0.03


def write_config(directory, preset: str, layers: int | None) -> str:
    """A model directory holding only the preset's config.json, at `layers` decoder layers
    (None: the preset's own depth). A Qwen3.5 keeps its last layer attention and the ones below
    Gated DeltaNet: at 2 layers one of each kind."""
    config = PRESETS[preset]
    if layers is not None:
        kinds = ("linear_attention",) * (layers - 1) + ("full_attention",)
        config = dataclasses.replace(
            config, num_hidden_layers=layers, layer_types=kinds if config.hybrid else ()
        )
    directory.mkdir()
    with open(directory / "config.json", "w") as f:
        json.dump(config.to_hf(), f)
    return str(directory)


def _layout_file(directory, model: str, world: int, layers: int | None) -> str:
    """A --layout file: MIXED_LAYERS with the fp32 state on the host, or at full depth what the
    dry run of the model chooses (written with --layout-out)."""
    path = str(directory / "layout.json")
    if layers is None:
        argv = ["--preset", "qwen3-8b-1m", "--model", model, "--dry-run", "--layout-out", path]
        run_train(1, *argv, env={"WORLD_SIZE": str(world)})
    else:
        with open(path, "w") as f:
            json.dump({"cpu_offload": True, "layers": MIXED_LAYERS}, f)
    return path


@pytest.fixture(scope="module")
def rehearsals(tmp_path_factory):
    """rehearsal.json of (shape, depth), rehearsed once for all the checks of that pair."""
    records = {}

    def rehearse(shape: str, depth: str) -> dict:
        if (shape, depth) not in records:
            preset, world, flags = SHAPES[shape]
            layers, depth_flags = DEPTHS[depth]
            d = tmp_path_factory.mktemp("rehearsal")
            model = write_config(d / "model", preset, layers)
            if "{layout}" in flags:
                layout = _layout_file(d, model, world, layers)
                flags = [layout if f == "{layout}" else f for f in flags]
            argv = ["--preset", "qwen3-8b-1m", "--model", model, *flags, *depth_flags]
            argv += ["--rehearse", "--out", str(d / "out")]
            # a full-depth 32B rehearsal takes minutes on a 2-core CPU, a Qwen3.5's up to half
            # an hour (the 35B-A3B's 40 layers of 256 experts)
            timeout = 1800 if layers is None else 300
            if PRESETS[preset].hybrid:
                timeout = 3600 if layers is None else 600
            run_train(1, *argv, env={"WORLD_SIZE": str(world)}, timeout=timeout)
            with open(d / "out" / "rehearsal.json") as f:
                records[shape, depth] = json.load(f)
        return records[shape, depth]

    return rehearse


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize(("depth", "shape"), CASES)
def test_the_plan_agrees_with_the_rehearsal(depth, shape, check, rehearsals):
    """rehearsal.json's measured figure against the planned one, within TOLERANCE (LoRA and
    MoE: LORA_TOLERANCE)."""
    record = rehearsals(shape, depth)
    rehearsed_at, planned_at = CHECKS[check]
    rehearsed, planned = at(record, rehearsed_at), at(record, planned_at)
    deviation = rehearsed / planned - 1
    print(f"{shape}, {check}: rehearsed {rehearsed:.6g}, planned {planned:.6g}, {deviation:+.2%}")
    preset, _, flags = SHAPES[shape]
    tight = "--lora-rank" in flags or PRESETS[preset].num_experts or PRESETS[preset].hybrid
    tolerance = LORA_TOLERANCE if tight else TOLERANCE
    assert abs(deviation) <= tolerance, (shape, check, rehearsed, planned, f"{deviation:+.2%}")
