"""The host memory a run may use, and what train.py does with it.

run/host_memory.py reads /proc and the cgroup files under a root that the tests point at a
tmp_path holding the files a machine would have (cgroup v1 and v2, limits or none, nested
cgroups, files missing). Then --host-mem-gb 0 (the default) becomes that number in the config the
planner reads, a dry run assumes the 2000 GB target node instead, and a CUDA run whose planned
host memory per node exceeds it is refused in train.main before any process group or weight.
"""

import os

import pytest
import torch
from dist_utils import run_distributed, run_train

import train
from memory.choices import plan_for_run
from memory.plan import GB
from model.config import ConfigError
from run import checks
from run.host_memory import host_memory_bytes, physical_memory_bytes

MEM_TOTAL_KB = 24_683_652  # this dev machine's /proc/meminfo line
MEM_TOTAL = MEM_TOTAL_KB * 1024
V1_NO_LIMIT = "9223372036854771712"  # what v1 reports without a limit (PAGE_COUNTER_MAX pages)


def _machine(root, files: dict[str, str], meminfo: bool = True) -> str:
    if meminfo:
        files = {
            "proc/meminfo": f"MemTotal:       {MEM_TOTAL_KB} kB\nMemFree:  1000 kB\n",
            **files,
        }
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)


def test_cgroup_v2_limit_below_physical_memory(tmp_path):
    root = _machine(
        tmp_path, {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "17179869184\n"}
    )
    assert host_memory_bytes(root) == (16 * 2**30, "cgroup v2 limit /sys/fs/cgroup/memory.max")


def test_cgroup_v2_max_is_no_limit(tmp_path):
    root = _machine(tmp_path, {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "max\n"})
    assert host_memory_bytes(root) == (MEM_TOTAL, "/proc/meminfo MemTotal")


def test_cgroup_v2_nested_job_takes_the_smallest_ancestor(tmp_path):
    """A Slurm-style job cgroup: the job's limit is on a parent, its step has a larger one."""
    root = _machine(
        tmp_path,
        {
            "proc/self/cgroup": "0::/slurm/job_7/step_0\n",
            "sys/fs/cgroup/slurm/job_7/memory.max": "8000000000\n",
            "sys/fs/cgroup/slurm/job_7/step_0/memory.max": "12000000000\n",
            "sys/fs/cgroup/slurm/memory.max": "max\n",
        },
    )
    assert host_memory_bytes(root) == (
        8_000_000_000,
        "cgroup v2 limit /sys/fs/cgroup/slurm/job_7/memory.max",
    )


def test_cgroup_v1_huge_value_is_no_limit_and_a_small_one_is(tmp_path):
    cgroup = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    none = _machine(
        tmp_path / "none",
        {
            "proc/self/cgroup": cgroup,
            "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NO_LIMIT,
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": V1_NO_LIMIT,
        },
    )
    assert host_memory_bytes(none) == (MEM_TOTAL, "/proc/meminfo MemTotal")
    limited = _machine(
        tmp_path / "limited",
        {
            "proc/self/cgroup": cgroup,
            "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NO_LIMIT,
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "4294967296\n",
        },
    )
    assert host_memory_bytes(limited) == (
        4 * 2**30,
        "cgroup v1 limit /sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes",
    )


def test_limit_above_physical_memory_is_not_reported(tmp_path):
    root = _machine(tmp_path, {"sys/fs/cgroup/memory.max": str(2 * MEM_TOTAL)})
    assert host_memory_bytes(root) == (MEM_TOTAL, "/proc/meminfo MemTotal")


def test_missing_files(tmp_path):
    """No cgroup files (nor /proc/self/cgroup): physical memory; no meminfo either: sysconf."""
    assert host_memory_bytes(_machine(tmp_path / "a", {})) == (MEM_TOTAL, "/proc/meminfo MemTotal")
    size, source = host_memory_bytes(_machine(tmp_path / "b", {}, meminfo=False))
    assert size == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert source == "os.sysconf physical pages"


def test_this_machine():
    size, source = host_memory_bytes()
    physical, _ = physical_memory_bytes()
    assert 0 < size <= physical <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") + 2**30
    print(f"this machine: {size / GB:.1f} GB from {source}")


# ---- what the run does with it ------------------------------------------------------------------
def _fake_machine(monkeypatch, size: int, source: str = "a fake cgroup") -> None:
    monkeypatch.setattr(checks, "host_memory_bytes", lambda: (size, source))


def test_zero_becomes_this_machines_number_and_reaches_the_plan(monkeypatch):
    _fake_machine(monkeypatch, 30 * 10**9)
    cfg = train.TrainConfig()
    assert cfg.host_mem_gb == 0
    mc, _, sp, dp = checks.check_run(cfg, 1, 1)
    assert cfg.host_mem_gb == 30.0
    assert plan_for_run(cfg, mc, 1, sp, dp, 4, "cpu").options.host_mem_gb == 30.0
    given = train.TrainConfig(host_mem_gb=123.0)
    checks.check_flags(given)
    assert given.host_mem_gb == 123.0
    dry = train.TrainConfig(dry_run=True)
    checks.check_flags(dry)
    assert dry.host_mem_gb == checks.DRY_RUN_HOST_MEM_GB == 2000.0


def test_negative_host_memory_is_refused():
    with pytest.raises(ConfigError, match="--host-mem-gb -1.0: must be 0"):
        checks.check_flags(train.TrainConfig(host_mem_gb=-1.0))


def test_cuda_run_over_host_memory_is_refused_before_anything_runs(monkeypatch, tmp_path):
    """train.main on a (pretended) CUDA machine of 2 GB: the plan's runtime share alone, 4 GB per
    process, is over it. Refused in the checks, before the process group, --out or a weight."""
    _fake_machine(monkeypatch, 2 * 10**9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train.main(["--model", "tiny", "--steps", "1", "--out", str(out), "--gpu-mem-gb", "80"])
    assert str(e.value).startswith("memory: no layout fits 1,024 tokens in 80 GB per GPU, 2 GB")
    assert "(this machine's memory, a fake cgroup)" in str(e.value)
    assert "needs 4 GB host per node of 2" in str(e.value)  # the runtime share alone
    assert "no row of 1,024 tokens fits either" in str(e.value)
    assert "\n" not in str(e.value) and not out.exists()
    # the same run with the memory it needs passes the checks
    _fake_machine(monkeypatch, 100 * 10**9)
    checks.check_run(train.TrainConfig(model="tiny", steps=1, out=str(out), gpu_mem_gb=80.0), 1, 1)


def test_cpu_offload_counts_and_is_named(monkeypatch):
    """--cpu-offload's host state is in the planned total: a limit between the two is refused
    only with it, and the message names it as a way out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    base = dict(model="qwen3-0.6b", seq_len=8192, steps=1, gpu_mem_gb=80.0)
    plain = train.TrainConfig(**base, host_mem_gb=1000.0)
    mc, _, sp, dp = checks.check_run(plain, 1, 1)
    off = train.TrainConfig(**base, cpu_offload=True, host_mem_gb=1000.0)
    low = plan_for_run(plain, mc, 1, sp, dp, 2, "cuda").host.per_node / GB
    high = plan_for_run(off, mc, 1, sp, dp, 2, "cuda").host.per_node / GB
    assert high > low + 1
    limit = (low + high) / 2
    checks.check_run(train.TrainConfig(**base, host_mem_gb=limit), 1, 1)
    with pytest.raises(
        ConfigError, match=rf"--host-mem-gb {limit:g}\).* without --cpu-offload the layout"
    ):
        checks.check_run(train.TrainConfig(**base, cpu_offload=True, host_mem_gb=limit), 1, 1)


def _ranks_settle(rank, world):
    checks.host_memory_bytes = lambda: ((30 - rank) * 10**9, f"node {rank}")  # this process's
    cfg = train.TrainConfig(model="tiny", steps=1, sp=1)
    checks.check_run(cfg, world, world)
    return cfg.host_mem_gb


def test_every_rank_plans_with_the_smallest_nodes_memory():
    """Each rank reads its own machine; with a process group they agree on the smallest."""
    assert run_distributed(_ranks_settle, 3) == [28.0, 28.0, 28.0]


def test_cpu_runs_are_not_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    checks.check_run(train.TrainConfig(model="tiny", steps=1, host_mem_gb=0.5), 1, 1)


def test_dry_run_plans_for_the_target_node_and_reports_a_misfit():
    p = run_train(1, "--preset", "qwen3-8b-1m", "--dry-run")
    assert '"host_mem_gb": 2000.0' in p.stdout and "of 2000 GB: fits" in p.stdout
    p = run_train(1, "--preset", "qwen3-8b-1m", "--dry-run", "--host-mem-gb", "24")
    assert p.returncode == 0 and "of 24 GB: DOES NOT FIT" in p.stdout
