"""model/parallel.py's torch 2.11/2.12 branch (_restart_head_unit_each_forward), run on torch 2.13.

Only 2.13 is installed here, so the test puts the older behaviour back: before 2.13, a grouped
FSDP2 unit ([final norm, lm_head]) ran its pre-forward (the all-gather) only when no module of
the group was still pending, and nothing completed a group whose lm_head never ran. These are
the two functions 2.13 changed; the emulation below is the 2.11/2.12 source of the first
(torch/distributed/fsdp/_fully_shard/_fsdp_state.py) and drops the second. Then, on 2 gloo
processes: an evaluation forward, a reshard (as state_dict() or save_safetensors do), and a
second forward must give the one-process answer, with the branch installed; without it the
second forward runs the norm on its shard and fails (the test checks that as well, so it shows
the branch is needed on those versions and does what it says).
"""

import torch
from dist_utils import run_distributed

from model.config import Qwen3Config

CFG = Qwen3Config(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    bos_token_id=None,
    eos_token_id=None,
)


def _old_group_hooks(modules, pre_hook, post_hook, modules_to_run, cast_output_dtype=None):
    """torch 2.11/2.12's _register_group_forward_hooks: pre-hook on the first module only."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _MultiHandle

    modules_set = set(modules)

    def wrapped_pre_hook(*args, **kwargs):
        if len(modules_to_run) == 0:  # first to run
            modules_to_run.update(modules_set)
            return pre_hook(*args, **kwargs)

    def get_wrapped_post_hook(module):
        def wrapped_post_hook(*args, **kwargs):
            modules_to_run.discard(module)
            if len(modules_to_run) == 0:
                return post_hook(*args, **kwargs)

        return wrapped_post_hook

    pre = [
        m.register_forward_pre_hook(wrapped_pre_hook, prepend=True, with_kwargs=True)
        for m in modules
    ]
    post = [
        m.register_forward_hook(get_wrapped_post_hook(m), prepend=False, always_call=True)
        for m in modules
    ]
    return _MultiHandle(tuple(pre + post))


def _worker(rank, world, ids, want):
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    import model.parallel as par

    _fsdp_state._register_group_forward_hooks = _old_group_hooks  # torch 2.11/2.12, in this process
    _fsdp_state.FSDPState._force_complete_incomplete_states = lambda self, output: output
    par._fsdp_finishes_grouped_units = lambda: False  # what the version check says there
    mesh = par.build_mesh(world, 1, "cpu")
    out = {}
    for branch in (True, False):
        restart = par._restart_head_unit_each_forward
        if not branch:
            par._restart_head_unit_each_forward = lambda model: None  # the branch removed
        torch.manual_seed(0)
        model, _ = par.build_sharded_model(CFG, mesh, device="cpu")
        par._restart_head_unit_each_forward = restart
        r = {"hooks": len(model._forward_pre_hooks)}
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # gathers, then reshards
        try:
            with torch.no_grad():
                first = model(ids)  # evaluation: no backward, lm_head never runs
            model.reshard()
            model.state_dict()
            with torch.no_grad():
                second = model(ids)
            r["diffs"] = [(x - want(full)).abs().max().item() for x in (first, second)]
            model(ids).square().mean().backward()  # and training still runs after it
            r["trained"] = True
        except Exception as e:  # the norm on its 1/world shard: a shape error
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out[branch] = r
    return out


def _one_process(full):
    from model.qwen3 import Qwen3

    m = Qwen3(CFG)
    m.load_state_dict(full)
    with torch.no_grad():
        return m(_IDS)


_IDS = torch.randint(0, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))


def test_pre_2_13_head_unit_branch_keeps_a_second_forward_right():
    res = run_distributed(_worker, 2, _IDS, _one_process)
    for rank, out in enumerate(res):
        print(rank, out)
        with_branch, without = out[True], out[False]
        assert with_branch["hooks"] == without["hooks"] + 1  # the branch found its private state
        assert "error" not in with_branch, with_branch
        assert max(with_branch["diffs"]) <= 1e-6 and with_branch["trained"]
        # without the branch the old torch fails exactly as the docstring says
        assert "error" in without or max(without["diffs"]) > 1e-3, without
