"""What a first GPU run would otherwise find out the expensive way, checked on the CPU: the
allocator setting made before torch can initialise CUDA, Ulysses on a process group of its own,
and the fused AdamW every path now uses against torch's foreach AdamW."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist
from dist_utils import run_distributed

from model.parallel import GROUP_TIMEOUT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs train.py as __main__ (a dry run) with an import hook that prints the allocator setting at
# the moment torch is first imported (CUDA cannot initialise before that) and ends the process
# there: what comes after cannot change it, and importing torch is most of a second's work.
WATCH_TORCH_IMPORT = r"""
import importlib.abc, os, runpy, sys
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.__stdout__.write(f"at torch import: {os.environ.get('PYTORCH_ALLOC_CONF')}\n")
            sys.__stdout__.flush()
            os._exit(0)
        return None
sys.meta_path.insert(0, Watch())
sys.argv = ["train.py", "--preset", "demo", "--dry-run"]
with open(os.devnull, "w") as quiet:
    sys.stdout = quiet
    runpy.run_path("train.py", run_name="__main__")
print("torch was never imported")
"""


def torch_import_setting(env: dict) -> str:
    keep = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    return last_line(WATCH_TORCH_IMPORT, {**keep, "WORLD_SIZE": "2", **env})  # 4 heads over 2


def last_line(script: str, env: dict) -> str:
    """The last line `python -c script` prints in the repository root, with `env`."""
    p = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def test_allocator_settings_are_set_before_torch_is_imported_unless_the_user_chose():
    """Expandable segments, and the host blocks pre-faulted by 8 threads, then cudaHostRegister."""
    want = "expandable_segments:True,"
    want += "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    assert torch_import_setting({}) == f"at torch import: {want}"
    mine = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}
    assert torch_import_setting(mine) == "at torch import: max_split_size_mb:512"
    legacy = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}  # the older name counts too
    assert torch_import_setting(legacy) == "at torch import: None"


def _timeout(group) -> float:
    """The seconds a gloo group waits in a collective before it aborts."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _ulysses_groups(rank, world, sp):
    from model.parallel import build_mesh, shard_mesh, ulysses_group

    mesh = build_mesh(world, sp, "cpu")
    group = ulysses_group(mesh)
    mesh_groups = [mesh[d].get_group() for d in ("dp", "sp")] + [shard_mesh(mesh).get_group()]
    x = torch.full((1,), float(rank))
    dist.all_reduce(x, group=group)  # the group works: the sum of its ranks
    return {
        "ranks": dist.get_process_group_ranks(group),
        "mesh_sp_ranks": dist.get_process_group_ranks(mesh["sp"].get_group()),
        "same_as_mesh": group is mesh["sp"].get_group(),
        "same_as_world": group is dist.group.WORLD,
        "sum": x.item(),
        "timeouts": [_timeout(g) for g in [group, *mesh_groups]],
    }


def test_ulysses_runs_on_a_group_of_its_own():
    """dp 1 x sp 2 (where the mesh's sp group is the world group FSDP2 uses) and dp 2 x sp 2."""
    for world, sp in ((2, 2), (4, 2)):
        for rank, got in enumerate(run_distributed(_ulysses_groups, world, sp)):
            assert got["ranks"] == got["mesh_sp_ranks"], (world, rank, got)
            assert not got["same_as_mesh"] and not got["same_as_world"], (world, rank)
            assert got["sum"] == sum(got["ranks"]), (world, rank, got)
            assert got["timeouts"] == [GROUP_TIMEOUT.total_seconds()] * 4, (world, rank, got)


# train.py's own process group (a plain `python train.py`: a group of one), then the mesh's and
# the Ulysses groups, as a run creates them: every one waits as long as the world group.
GROUP_TIMEOUTS = r"""
import torch
import train
from model.parallel import build_mesh, shard_mesh, ulysses_group
train.init_distributed()
mesh = build_mesh(1, 1, "cpu")
groups = [torch.distributed.group.WORLD, ulysses_group(mesh), mesh["dp"].get_group(),
          mesh["sp"].get_group(), shard_mesh(mesh).get_group()]
print([g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups])
"""


def test_every_process_group_waits_as_long_as_the_world_group():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    world, *others = eval(last_line(GROUP_TIMEOUTS, env))
    assert world == GROUP_TIMEOUT.total_seconds() == 3600
    assert others == [world] * 4


def test_make_optimizer_is_fused_and_equals_foreach_adamw():
    import train

    cfg = train.TrainConfig(lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(19, 37), torch.nn.LayerNorm(37))
    twin = torch.nn.Sequential(torch.nn.Linear(19, 37), torch.nn.LayerNorm(37))
    twin.load_state_dict(model.state_dict())
    fused = train.make_optimizer(cfg, model)
    assert fused.defaults["fused"] is True
    decay = [p for p in twin.parameters() if p.ndim >= 2]
    no_decay = [p for p in twin.parameters() if p.ndim < 2]
    foreach = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.adam_eps,
        foreach=True,
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        fused.step()
        foreach.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert p.sub(q).abs().max() > 0 or p.ndim < 2  # two kernels: rounding differs, a little
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
