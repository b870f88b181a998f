"""Each piece copied alone into someone else's code: docs/pieces.md's snippets, on transformers
models.

For each piece in docs/pieces.md ("Use a piece in your own code"), the files its "Copy ..." line
names (and nothing else of this repository) go into an empty directory, and the snippet under its
`<!-- snippet: NAME -->` marker runs there, in a process whose sys.path holds that directory and
the installed packages only, on tiny random transformers models. The reference is the plain
transformers model: loss and every parameter's gradient within 1e-6 relative in fp32 (the norm
of the difference over the norm of the reference, per parameter). Ulysses runs on 2 and 4 gloo
ranks, the loss's group mean on 2, each against one process.

The processes are forked from one server started with `python -P` outside the repository, which
imports torch and transformers once (6 s of CPU each time otherwise, on a 2-core machine); a
child puts its directory first on sys.path and checks that nothing of this repository imports.
"""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL = 1e-6

# The server: imports once, then forks a child per request {"dir", "script"}; one line back each,
# the child's exit status. The child runs `script` with `dir` first on sys.path, output to dir/log.
SERVER = r"""
import json, os, sys, traceback
import torch, torch.distributed, torch.multiprocessing
import transformers
from transformers import LlamaForCausalLM, Qwen3ForCausalLM
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            log = os.open(os.path.join(job["dir"], "log"), os.O_WRONLY | os.O_CREAT)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.chdir(job["dir"])
            sys.path.insert(0, job["dir"])
            with open(job["script"]) as f:
                exec(compile(f.read(), job["script"], "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""

# Every script starts with this: nothing of the repository on the path or importable, one
# thread, and tiny random transformers models (norms moved off 1, so a skipped norm shows).
PRELUDE = r"""
import copy, importlib.util, os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = {root!r}
def inside_root(path):  # ROOT itself or below it; a sibling such as ROOT + "venv" is not
    path = os.path.abspath(path or ".")
    return path == ROOT or path.startswith(ROOT + os.sep)
def installed(path):  # a virtualenv made inside the checkout (ROOT/.venv) holds packages, not ours
    return os.path.basename(os.path.abspath(path or ".")) in ("site-packages", "dist-packages")
assert not any(inside_root(p) and not installed(p) for p in sys.path), sys.path
for name in ("model", "loss", "train", "memory", "bench"):
    assert importlib.util.find_spec(name) is None, name + " imports in the copy's directory"
torch.set_num_threads(1)
SNIPPET = {snippet!r}


def tiny(arch="qwen3", heads=4, kv_heads=2, seed=0, attn="sdpa"):
    import transformers

    config_type, model_type = {{
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }}[arch]
    config = config_type(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
        tie_word_embeddings=False, attn_implementation=attn,
    )  # use_cache stays at its default (on): train mode then builds a cache
    torch.manual_seed(seed)
    model = model_type(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def ids(batch, length, seed=1):
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def grads(model):
    return {{n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def reference(model, input_ids, labels=None, attention_mask=None):
    labels = input_ids if labels is None else labels
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    return {{"loss": loss.detach(), "grads": grads(model)}}


def snippet(**names):
    exec(SNIPPET, names)
    return names


def on_ranks(fn, world, *args):
    # fn(*args) on `world` gloo ranks forked from here; rank 0's result
    ctx, out = mp.get_context("fork"), os.path.abspath(f"rank0-{{world}}.pt")
    procs = [ctx.Process(target=_rank, args=(r, world, fn, out, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return torch.load(out)


def _rank(rank, world, fn, out, args):
    store = os.path.abspath(f"store-{{world}}")
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def summed(t):
    t = t.detach().clone()
    dist.all_reduce(t)
    return t
"""

# What each piece runs; `done(result)` saves what the test compares.
DRIVERS = {
    "loss": r"""
def loss_case(world):
    model, input_ids = tiny(), ids(2, 12)
    labels = input_ids.clone()
    labels[0, :5] = -100  # a prompt not counted: the ranks count 7 and 11 labels
    ref = reference(copy.deepcopy(model), input_ids, labels)
    if world:
        rank = dist.get_rank()
        input_ids, labels = input_ids[rank : rank + 1], labels[rank : rank + 1]  # one row each
    ns = snippet(model=model, input_ids=input_ids, labels=labels)
    got = {"loss": ns["loss"].detach(), "grads": grads(model)}
    if world:  # the group's loss and gradients: the sums over its ranks
        summed_grads = {n: summed(g) for n, g in got["grads"].items()}
        got = {"loss": summed(got["loss"]), "grads": summed_grads}
    return {"ref": ref, "got": got}


two = on_ranks(loss_case, 2, 2)  # first: no torch op here yet
done({"one process": loss_case(0), "2 ranks": two})
""",
    "offload": r"""
import gc
import warnings


def live_kv(shape):
    # tensors shaped like one layer's K or V [B, kv heads, T, head_dim] alive right now
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        return sum(isinstance(o, torch.Tensor) and o.shape == shape for o in gc.get_objects())


def offload_case(arch, attn, padded):
    model, input_ids = tiny(arch, attn=attn), ids(2, 12)
    attention_mask, labels = None, input_ids
    if padded:  # row 1 is 8 tokens and 4 of padding, not counted
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 8:] = 0
        labels = input_ids.masked_fill(attention_mask == 0, -100)
    ref = reference(copy.deepcopy(model), input_ids, labels, attention_mask)
    kv_shape = (2, model.config.num_key_value_heads, 12, model.config.head_dim)
    kv_at_backward = []  # counted as backward starts: after every layer's forward
    model.lm_head.register_full_backward_pre_hook(
        lambda *_: kv_at_backward.append(live_kv(kv_shape))
    )
    ns = snippet(model=model, input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return {
        "ref": ref,
        "got": {"loss": ns["loss"].detach(), "grads": grads(model)},
        "stats": ns["stats"].as_dict(),
        "in_flight": ns["pool"].copies_in_flight(),
        "layers": model.config.num_hidden_layers,
        "input_bytes": input_ids.numel() * model.config.hidden_size * 4,  # [B, T, hidden] fp32
        "kv_at_backward": kv_at_backward,
    }


CASES = [("qwen3", "sdpa", False), ("llama", "sdpa", False), ("qwen3", "eager", True),
         ("llama", "eager", True), ("qwen3", "sdpa", True)]
done({f"{arch}, {attn}, {'padded' if padded else 'no mask'}": offload_case(arch, attn, padded)
      for arch, attn, padded in CASES})
""",
    "tiled_mlp": r"""
def saved_shapes(fn):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


model, input_ids = tiny(), ids(2, 13)  # 26 tokens: tiles of 4 and a ragged one of 2
plain = copy.deepcopy(model)
result = {}
result["plain_saved"] = saved_shapes(lambda: result.update(ref=reference(plain, input_ids)))
result["saved"] = saved_shapes(lambda: result.update(ns=snippet(model=model, input_ids=input_ids)))
result["got"] = {"loss": result.pop("ns")["loss"].detach(), "grads": grads(model)}
result["batch"], result["intermediate"] = tuple(input_ids.shape), model.config.intermediate_size
done(result)
""",
    "ulysses": r"""
HEADS = [(8, 2), (4, 4), (4, 1)]  # (query, kv) heads: kv repeated where sp exceeds them


def ulysses_case(heads, kv_heads):
    model, input_ids = tiny(heads=heads, kv_heads=kv_heads), ids(2, 16)
    ns = snippet(model=model, input_ids=input_ids)
    return {"loss": summed(ns["loss"]), "grads": grads(model)}  # the snippet sums the gradients


def all_heads():
    return [ulysses_case(h, kv) for h, kv in HEADS]


ranks = {world: on_ranks(all_heads, world) for world in (2, 4)}  # first: no torch op here yet
refs = [reference(tiny(heads=h, kv_heads=kv), ids(2, 16)) for h, kv in HEADS]
done({
    f"sp={world}, {h} q / {kv} kv heads": {"ref": refs[i], "got": ranks[world][i]}
    for world in (2, 4)
    for i, (h, kv) in enumerate(HEADS)
})
""",
}


PIECES_PAGE = os.path.join(ROOT, "docs", "pieces.md")


def page_pieces() -> dict[str, tuple[list[str], str]]:
    """name -> (files its "Copy" line names, snippet), one per `## ` section of docs/pieces.md."""
    with open(PIECES_PAGE) as f:
        text = f.read()
    pieces = {}
    for part in text.split("\n## ")[1:]:
        name, code = re.search(r"<!-- snippet: (\w+) -->\n```python\n(.*?)```", part, re.S).groups()
        copy_line = re.search(r"^Copy (.*)$", part, re.M).group(1)
        pieces[name] = (re.findall(r"`([\w/]+\.py)`", copy_line), code)
    return pieces


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", SERVER],
        cwd=tmp_path_factory.mktemp("copier"),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a hung child is killed with it
    )
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def run_piece(server, tmp_path, name: str) -> dict:
    """The page's snippet `name` in a directory holding only its files; what the driver saved."""
    files, snippet = page_pieces()[name]
    assert files, f"docs/pieces.md names no file to copy for {name}"
    piece = tmp_path / name
    piece.mkdir()
    for path in files:
        shutil.copy(os.path.join(ROOT, path), piece / os.path.basename(path))
    out = tmp_path / f"{name}.pt"
    script = tmp_path / f"{name}_trainer.py"  # the copier's own code, outside the directory
    done = f"\n\ndef done(result):\n    torch.save(result, {str(out)!r})\n\n"
    script.write_text(PRELUDE.format(root=ROOT, snippet=snippet) + done + DRIVERS[name])
    server.stdin.write(json.dumps({"dir": str(piece), "script": str(script)}) + "\n")
    server.stdin.flush()
    if not select.select([server.stdout], [], [], 300)[0]:
        os.killpg(server.pid, signal.SIGKILL)
        pytest.fail(f"{name}: no answer in 300 s")
    code = server.stdout.readline().strip()
    log = (piece / "log").read_text() if (piece / "log").exists() else ""
    assert code == "0", f"{name} failed ({code}):\n{log[-6000:]}"
    return torch.load(out, weights_only=False)


def assert_same(case: str, got: dict, ref: dict) -> None:
    """Loss and every parameter's gradient of `got` within REL of transformers' own `ref`."""
    err = abs(got["loss"].item() - ref["loss"].item()) / abs(ref["loss"].item())
    assert err <= REL, f"{case}: loss {got['loss'].item()} vs {ref['loss'].item()}"
    assert got["grads"].keys() == ref["grads"].keys(), case
    for n, g0 in ref["grads"].items():
        diff = (got["grads"][n] - g0).norm().item()
        assert diff <= REL * g0.norm().item(), f"{case}: {n} off by {diff / g0.norm().item():.2e}"


def test_pieces_page_names_each_piece_once_with_files_that_exist():
    pieces = page_pieces()
    assert sorted(pieces) == ["loss", "offload", "tiled_mlp", "ulysses"]
    for name, (files, snippet) in pieces.items():
        assert all(os.path.exists(os.path.join(ROOT, f)) for f in files), (name, files)
        assert len(textwrap.dedent(snippet).strip().splitlines()) <= 15, name


PRIVATE_TORCH = re.compile(r"\btorch(?:\.\w+)*\._(?!_)\w*")  # torch._x, torch.a._b; not __version__


def test_pieces_import_public_torch_only():
    """A copied piece must not break on a torch upgrade: no file a piece names imports or calls
    a private torch name (a module or attribute whose name starts with one underscore). What a
    rehearsal on fake tensors needs from torch's internals lives in memory/rehearsal.py."""
    files = sorted({f for names, _ in page_pieces().values() for f in names})
    assert "loss/chunked_ce.py" in files and "model/host_pool.py" in files, files
    for path in files:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        found = PRIVATE_TORCH.findall(text)
        assert not found, f"{path} names private torch: {found}"


@pytest.mark.slow
def test_loss_copied_alone(server, tmp_path):
    """The chunked loss from transformers' hidden states and lm_head weight, alone and with its
    group mean on 2 ranks counting 7 and 11 labels: transformers' mean over all 18."""
    for case, r in run_piece(server, tmp_path, "loss").items():
        assert_same(case, r["got"], r["ref"])


@pytest.mark.slow
def test_offload_copied_alone(server, tmp_path):
    """transformers' Qwen3 and Llama decoder layers wrapped, with SDPA and eager attention, a
    padding mask and the config's default use_cache (a cache built in train mode): their
    gradients, every layer's input went to the host and came back (the pool's public counters),
    and no layer's K/V is left alive once its forward is done."""
    for arch, r in run_piece(server, tmp_path, "offload").items():
        assert_same(arch, r["got"], r["ref"])
        assert r["kv_at_backward"] == [0], (arch, r["kv_at_backward"])
        s, L, n = r["stats"], r["layers"], r["input_bytes"]
        assert (s["d2h_copies"], s["h2d_copies"]) == (L, L), (arch, s)
        assert (s["d2h_bytes"], s["h2d_bytes"]) == (L * n, L * n), (arch, s)
        assert s["in_use_buffers"] == 0 and r["in_flight"] == 0, (arch, s)  # all given back


@pytest.mark.slow
def test_tiled_mlp_copied_alone(server, tmp_path):
    """transformers' Qwen3 MLPs tiled over a ragged last tile: its gradients, and no
    [tokens, intermediate] tensor saved for backward (the plain model saves several)."""
    r = run_piece(server, tmp_path, "tiled_mlp")
    assert_same("tiled", r["got"], r["ref"])

    def full_width(shapes):
        B, T = r["batch"]
        tokens = ((B, T), (B * T,))  # [B, T, intermediate] or [B * T, intermediate]
        return [s for s in shapes if s[-1:] == (r["intermediate"],) and s[:-1] in tokens]

    assert full_width(r["plain_saved"]), "the plain MLP saves [tokens, intermediate] tensors"
    assert not full_width(r["saved"]), full_width(r["saved"])


@pytest.mark.slow
def test_ulysses_copied_alone(server, tmp_path):
    """transformers' Qwen3 with its row split over 2 and 4 gloo ranks, kv heads split, repeated
    (fewer than sp) or one per query head: the loss and gradients of the model in one process."""
    for case, r in run_piece(server, tmp_path, "ulysses").items():
        assert_same(case, r["got"], r["ref"])
