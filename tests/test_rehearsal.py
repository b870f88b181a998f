"""train.py --rehearse: the real step on fake tensors measures what the real step measures.

The rehearsal runs train_step under torch's FakeTensorMode with a fake process group and counts
live storages with the same meter as a real CPU step (memory/meter.py). Three silent failures would
each give a wrong number and no error, so each has its own test here: the offload pool leaving fake
tensors on the "device", the meter recognising host blocks by data_ptr() (0 for every fake tensor)
and the meter skipping resizes of meta storages (every fake storage is one). Then real train.py
runs with --measure-memory against --rehearse of the same flags, end to end on three layouts
(tests/test_memory_matrix.py holds every layout of its matrix to the same 1%, step by step).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from attention_shapes_only import attention_shapes_only
from dist_utils import run_train
from torch._subclasses.fake_tensor import FakeTensorMode

from loss.chunked_ce import chunked_cross_entropy
from memory.meter import StepMeter
from model.checkpoint_offload import offload_layers
from model.host_pool import HostPool

MB = 2**20


def test_the_pool_moves_fake_activations_to_host():
    """A layer's input under FakeTensorMode goes to the pool like a real one (the pool once took
    only `type(t) is torch.Tensor`, so under a rehearsal nothing was offloaded, silently)."""
    with FakeTensorMode():
        layer = torch.nn.Linear(256, 256)
        pool = HostPool(min_bytes=0)
        offload_layers([layer], pool)
        x = torch.randn(1024, 256, requires_grad=True)
        layer(x).sum().backward()
        moved = pool.reset_step()
    assert moved.d2h_copies >= 1 and moved.d2h_bytes >= x.numel() * 4, moved


def test_the_meter_knows_fake_host_blocks_by_identity():
    """Host blocks are left out of the peak by identity: with fake tensors every data_ptr() is 0,
    so matching by pointer would drop every tensor (or none)."""
    with FakeTensorMode():
        host = torch.empty(10 * MB, dtype=torch.uint8)  # a "host block", alive at the end
        meter = StepMeter("cpu", host=[host]).start()
        device = torch.empty(MB, dtype=torch.uint8)
        also_host = host.view(-1)  # the same storage seen again inside the step
        meter.stop()
        del device, also_host
    assert meter.peak_bytes == MB


def test_the_meter_counts_resizes_of_fake_storages():
    """FSDP2 frees its gathered parameters with untyped_storage().resize_(0); a fake tensor's
    storage is a meta storage, and skipping those missed every free."""
    with FakeTensorMode():
        meter = StepMeter("cpu").start()
        gathered = torch.empty(4 * MB, dtype=torch.uint8)
        gathered.untyped_storage().resize_(0)  # freed, as FSDP2 reshards
        other = torch.empty(4 * MB, dtype=torch.uint8)
        meter.stop()
        del gathered, other
    assert meter.peak_bytes == 4 * MB


def test_the_loss_without_a_label_scan_equals_cross_entropy():
    """ignore_index=None (every label counts, no data-dependent nonzero) is the plain loss."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (37,), generator=g)
    ours = chunked_cross_entropy(h, w, y, chunk_size=8, ignore_index=None)
    ours.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy(h @ w.T, y, reduction="sum")
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(gh, h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, w.grad, rtol=1e-10, atol=1e-12)


# name: (processes, flags); the tiny preset, 4,096-token rows: activations make the peak
LAYOUTS = {
    "sp1": (1, ["--sp", "1"]),
    "sp2 bf16 tiled save attention": (
        2,
        ["--sp", "2", "--dtype", "bfloat16", "--tile-mlp", "512", "--save-attention"],
    ),
    "dp2 x sp2 cpu offload": (4, ["--sp", "2", "--cpu-offload"]),
}
COMMON = [
    "--model", "tiny", "--data", "synthetic:copy", "--seq-len", "4096", "--steps", "2",
    "--offload-min-bytes", "0", "--dtype", "float32", "--no-save-final",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_rehearsal_measures_what_the_cpu_meter_measures(name, tmp_path):
    """Steps 1 and 2 of real train.py (--measure-memory: the largest rank's peak) against the
    rehearsal of the same flags, within 1%: same code, same meter, so nearly to the byte. The
    real run's CPU attention skips its arithmetic (tests/attention_shapes_only.py), which changes
    no byte the meter counts."""
    nproc, flags = LAYOUTS[name]
    flags = COMMON + flags  # a later --dtype wins
    real_flags = [*flags, "--eval-every", "0", "--measure-memory"]
    # the real run's attention returns its shapes without the arithmetic: what is measured
    run_train(nproc, *real_flags, "--out", str(tmp_path / "real"), setup=attention_shapes_only)
    with open(tmp_path / "real" / "metrics.jsonl") as f:
        real = [json.loads(line)["peak_mem_gb"] * 1e9 for line in f]
    p = run_train(
        1, *flags, "--rehearse", "--out", str(tmp_path / "fake"), env={"WORLD_SIZE": str(nproc)}
    )
    assert "rehearsed" in p.stdout and "GB per GPU" in p.stdout, p.stdout[-2000:]
    with open(tmp_path / "fake" / "rehearsal.json") as f:
        fake = json.load(f)["peak_bytes"]
    print(name, real, fake)
    assert abs(fake["step1"] / real[0] - 1) <= 0.01, (name, real, fake)
    assert abs(fake["step2"] / real[1] - 1) <= 0.01, (name, real, fake)


def test_one_block_of_the_delta_rule_stands_for_all_in_peak_and_flops(monkeypatch):
    """memory/rehearsal.py's OneBlockDeltaRule against the real rule on fake tensors, forward and
    backward of 8 blocks (4 chunks each): the same peak live bytes and FLOPs within 2%, from a
    fifth of the operations. (The one block runs through the public rule, whose own output and
    zeroed block gradients it adds: 1.3% either way at these small shapes, ~0.2% at Qwen3.5-9B's;
    leaving out the whole-row gradients is 15% short, the FLOPs of the other blocks 8x.)"""
    import model.delta_rule as dr
    from memory.rehearsal import FlopCount, OneBlockDeltaRule

    monkeypatch.setattr(dr, "BLOCK_CHUNKS", 4)
    t, hk, hv, d = 8 * 4 * 64, 2, 4, 32

    def measure(rule):
        flops, ops = FlopCount(()), OpCount()
        if isinstance(rule, OneBlockDeltaRule):
            rule.flops = flops
        with FakeTensorMode():
            q, k = (torch.empty(1, t, hk, d, dtype=torch.bfloat16) for _ in range(2))
            v, beta = torch.empty(1, t, hv, d, dtype=torch.bfloat16), torch.empty(1, t, hv)
            g = torch.empty(1, t, hv)
            inputs = [x.requires_grad_() for x in (q, k, v, g, beta.bfloat16())]
            with StepMeter("cpu", baseline=inputs) as meter, flops, ops:
                rule(*inputs).sum().backward()
        return meter.peak_bytes - meter.start_bytes, flops.total, ops.count

    real = measure(dr.gated_delta_rule)
    one = measure(OneBlockDeltaRule())
    print(f"peak {one[0]:,} B (real {real[0]:,}), FLOPs {one[1]:.4e} ({real[1]:.4e}), "
          f"operations {one[2]:,} ({real[2]:,})")  # fmt: skip
    assert one[0] == pytest.approx(real[0], rel=0.02)
    assert one[1] == pytest.approx(real[1], rel=0.02)
    assert one[2] < real[2] / 5


class OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """How many aten operations run under it."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))
