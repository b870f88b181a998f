import torch
import torch.distributed as dist
from dist_utils import run_distributed


def _allreduce(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_gloo_group_sums_across_ranks():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]
