"""memory/meter.py against peaks computed by hand, FSDP2's gathers, CUDA's own count, and the
RMSNorm working set it was built to cut."""

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_utils import run_distributed  # noqa: E402

from memory.meter import StepMeter  # noqa: E402

MiB = 1 << 20


def _chain(device):
    """A chain of ops whose live bytes are known: peak 4 MiB above the start, 1 MiB kept at the
    end."""
    a = torch.ones(MiB // 4, device=device)  # 1 MiB
    b = a * 2  # 2 live
    del a
    c = torch.cat([b, b])  # b 1 + c 2 = 3
    del b
    d = c.view(2, -1).t().contiguous()  # c 2 + d 2 = 4: the peak
    del c
    e = d[: MiB // 4].clone().view(-1)  # d 2 + e ... views share d's storage
    del d
    x = torch.ones(64, 64, device=device, requires_grad=True)  # backward: 16 KiB tensors, far below
    (x.exp() * x).sum().backward()
    return e, x


def test_meter_counts_a_known_chain():
    keep = torch.empty(MiB, dtype=torch.uint8)
    with StepMeter("cpu", baseline=[keep]) as m:
        e, x = _chain("cpu")
    assert m.start_bytes == MiB
    assert m.peak_bytes == MiB + 4 * MiB
    assert (
        m.end_bytes == MiB + e.untyped_storage().nbytes() + 2 * x.untyped_storage().nbytes()
    )  # x and x.grad


def test_recording_names_where_each_tensor_was_made_even_in_code_without_a_file():
    """record=True names each tensor live at the peak by dir/file:line of the code that made it;
    code compiled without a file (python -c, exec, a notebook's cell) is named as it is."""
    made_here = "tests/test_meter.py:"
    with StepMeter("cpu", record=True) as m:
        kept = torch.empty(MiB, dtype=torch.uint8)
        also = eval(compile("torch.empty(2 * MiB, dtype=torch.uint8)", "<string>", "eval"))
    where = [op for _, op in m.at_peak]
    assert any(op.endswith("@ <string>:1") for op in where), where
    assert any(made_here in op for op in where), where
    del kept, also


def test_meter_leaves_out_host_buffers():
    host = []
    with StepMeter("cpu", host=host) as m:
        host.append(torch.empty(3 * MiB, dtype=torch.uint8))  # a host buffer made during the step
        t = torch.empty(MiB, dtype=torch.uint8)
    assert m.peak_bytes == m.end_bytes == MiB
    del t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_meter_equals_cuda_max_memory_allocated():
    dev = torch.device("cuda")
    base = torch.cuda.memory_allocated()
    with StepMeter(dev) as cuda_m:
        _chain(dev)
    with StepMeter(dev, force_cpu_meter=True) as cpu_m:
        _chain(dev)
    # CUDA rounds blocks to 512 B; these sizes are multiples of it
    assert cuda_m.peak_bytes - base == cpu_m.peak_bytes - cpu_m.start_bytes == 4 * MiB


def _gather(rank, world):
    """A 256 x 256 Linear sharded by FSDP2 over gloo. Kept gathered after forward, the full weight
    lives in a storage FSDP2 resized up; resharded, FSDP2 resizes that storage back to 0 bytes
    (no op output says so: only the meter's resize_ hook sees it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for reshard in (False, True):
        lin = torch.nn.Linear(256, 256, bias=False)
        fully_shard(lin, mesh=mesh, reshard_after_forward=reshard)
        x = torch.ones(4, 256, requires_grad=True)
        with StepMeter("cpu", model=lin, baseline=[x]) as m:
            y = lin(x)
            # gloo's worker thread lets go of the all-gather's output buffer a moment after the
            # collective completes (the buffer dies on that thread): give it that moment, so that
            # end_bytes is what FSDP2 kept, not who won the race (without: ~1 run in 3 failed).
            time.sleep(0.2)
        with StepMeter("cpu", model=lin, baseline=[x]) as b:
            y.sum().backward()
        out[reshard] = (
            m.start_bytes,
            m.end_bytes,
            m.peak_bytes,
            y.untyped_storage().nbytes(),
            b.peak_bytes,
        )
    return out


@pytest.mark.slow
def test_meter_sees_fsdp2_gathered_parameters_and_backward():
    full = 256 * 256 * 4
    for r in run_distributed(_gather, 2):
        for reshard, (start, end, peak, out, bwd) in r.items():
            assert start == 256 * 128 * 4 + 4 * 256 * 4  # the shard and x
            assert peak >= start + full + out  # the gathered weight while the output is made
            assert end == start + out + (
                0 if reshard else full
            )  # resharded: the full weight is gone
            assert (
                bwd >= start + full + 256 * 256 * 4
            )  # gathered weight and its full gradient in backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_chunks_same_numbers_less_memory(dtype, monkeypatch):
    """The chunked norm: the same outputs and gradients as one chunk, and its peak in forward and
    backward stays within one chunk of fp32 temporaries above its inputs and outputs."""
    from model.qwen3 import RMSNorm, _RMSNormFn

    torch.manual_seed(0)
    n, d = 4096, 64
    norm = RMSNorm(d, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, n, d, dtype=dtype, requires_grad=True)
    dy = torch.randn(1, n, d, dtype=dtype)

    def run(chunk):
        monkeypatch.setattr(_RMSNormFn, "CHUNK_ELEMS", chunk)
        x.grad = norm.weight.grad = None
        with StepMeter("cpu", model=norm, baseline=[x, dy]) as m:
            y = norm(x)
            y.backward(dy)
        return y.detach(), x.grad, norm.weight.grad, m.peak_bytes - m.start_bytes

    whole, chunked = run(n * d), run(512 * d)
    torch.testing.assert_close(chunked[0], whole[0], rtol=0, atol=0)
    torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=0)
    torch.testing.assert_close(chunked[2], whole[2], rtol=1e-5, atol=1e-5)  # dw: per-chunk sums
    X = n * d * x.element_size()
    # y, dx (X each) and the [N, 1] rstd, plus fp32 temporaries of one 512-row chunk
    assert chunked[3] <= 2 * X + n * 4 + 6 * 512 * d * 4 + 4 * d * 4
    assert (
        whole[3] >= chunked[3] + 4 * n * d * 4 - 6 * 512 * d * 4
    )  # one chunk: several fp32 copies of x
    print(
        f"{dtype}: norm forward+backward above inputs: "
        f"whole {whole[3]:,} B, chunked {chunked[3]:,} B"
    )


@pytest.mark.slow
def test_train_measure_memory_records_measured_and_planned(tmp_path):
    """train.py --measure-memory: each record has the meter's peak and this run's plan, and the two
    agree (the planner computed here from the same settings, independently of train.py's call)."""
    import json

    from dist_utils import run_train

    from memory.plan import plan
    from model.config import Qwen3Config

    r = run_train(
        1,
        "--model",
        "tiny",
        "--steps",
        "2",
        "--seq-len",
        "2048",
        "--measure-memory",
        "--no-save-final",
        "--out",
        str(tmp_path),
        "--offload-min-bytes",
        "0",
        "--tile-mlp",
        "256",
        "--loss-chunk",
        "128",
        "--dtype",
        "float32",
    )
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    first, rec = [r for r in records if not r.get("eval")]
    p = plan(
        Qwen3Config.preset("tiny"),
        2048,
        gpus=1,
        sp=1,
        offload=True,
        tiled_mlp=True,
        mlp_tile=256,
        loss_chunk=128,
        compute_bytes=4,
        device="cpu",
        save_attention=True,  # the run's own choice: its host memory has room for attention once
    )
    assert rec["planned_peak_gb"] == p.total / 1e9
    assert abs(rec["peak_mem_gb"] / rec["planned_peak_gb"] - 1) <= 0.05, rec
    # step 1 has no AdamW states at its peak: its own figure, and the same 5%
    assert first["planned_peak_gb"] == p.first_step_total / 1e9 < rec["planned_peak_gb"]
    assert abs(first["peak_mem_gb"] / first["planned_peak_gb"] - 1) <= 0.05, first
    assert "GB measured" in r.stdout and "GB planned" in r.stdout


def _all_to_alls(rank, world, n):
    """n all-to-alls whose send buffer the caller drops at once, under the meter: in how many was
    that buffer still alive right after (gloo's worker thread not yet done with it)?"""
    import weakref

    import torch.distributed as dist

    late = 0
    with StepMeter("cpu"):
        for _ in range(n):
            send = torch.randn(world, 1000)
            freed = []
            weakref.finalize(send.untyped_storage(), freed.append, True)
            out = torch.empty_like(send)
            dist.all_to_all_single(out, send)
            del send
            late += not freed
    return late


@pytest.mark.slow
def test_meter_waits_for_gloos_worker_to_let_go():
    """gloo's worker thread holds a collective's tensors a moment after it returns (without the
    meter's wait, 20% of these send buffers outlive the caller's del): under the meter none does,
    so a free is counted where the code frees, whatever the load on the machine."""
    late = run_distributed(_all_to_alls, 2, 500)
    assert late == [0, 0], late
