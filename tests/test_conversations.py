"""Conversations: the labels the loss counts, and train.py on them against transformers.

The tokenizer is a tiny byte-level BPE trained here, with Qwen3's special tokens and a
Qwen3-style ChatML template written here (QWEN3_STYLE: system prompt with the row's tools,
reasoning in <think>, tool calls, tool responses as a user turn). The counted labels are
checked against a reference that works on token ids (each "<|im_start|>assistant\\n" header's
ids found in the conversation's ids, then every id through the next "<|im_end|>"), not on the
product's character spans; the {% generation %} path against the same reference. train.py's
first step on packed conversations is checked against transformers' Qwen3ForCausalLM run on
each conversation alone with its labels masked to the assistant's tokens.
"""

import json
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_train
from hf_ref import hf_model, save_hf
from test_train import CFG, _common, eval_records, metrics

from data.conversations import DataError, Renderer, data_kind
from data.rows import build_rows

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
WORDS = "the ship sailed north and we saw ice it was cold one two three four five yes no".split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# Qwen3's ChatML as this test writes it: "<|im_start|>{role}\n...<|im_end|>\n" per turn; the
# row's tools in the system turn; an assistant's reasoning_content as "<think>\n...\n</think>\n\n"
# before its content (an empty one on the last turn, and "<think>\n" in the generation prompt,
# as Qwen3 renders them); reasoning written inline in the content dropped (the template rewrites
# the assistant's text); each tool call as "<tool_call>\n{"name": ..., "arguments": ...}\n
# </tool_call>"; a tool's response as a user turn holding "<tool_response>\n...\n</tool_response>";
# any other role not rendered.
QWEN3_STYLE = r"""
{%- set ns = namespace(first=0) %}
{%- if messages[0].role == 'system' %}
    {%- set ns.first = 1 %}
    {{- '<|im_start|>system\n' + messages[0].content }}
    {%- if tools %}{{- '\n\n' }}{%- endif %}
{%- elif tools %}
    {{- '<|im_start|>system\n' }}
{%- endif %}
{%- if tools %}
    {{- '# Tools\n\nTo call a function, answer {"name": ..., "arguments": ...} in a tool call.' }}
    {{- '\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
    {{- '\n</tools>' }}
{%- endif %}
{%- if ns.first or tools %}{{- '<|im_end|>\n' }}{%- endif %}
{%- for message in messages[ns.first:] %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content %}
        {%- set reasoning = reasoning.strip('\n') if reasoning is string else '' %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {{- '<|im_start|>assistant\n' }}
        {%- if reasoning or loop.last %}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function or call %}
            {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}
"""
# A ChatML template with {% generation %} markers around what the assistant says.
MARKED = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
)


def words(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def varied(rng) -> list[dict]:
    """Rows of every shape the template renders: multi-turn, a system prompt, a reasoning turn,
    a tool call and its response (with the row's tools)."""
    rows = []
    for i in range(8):
        msgs = [{"role": "system", "content": words(rng, 4)}] if i % 2 else []
        for _ in range(1 + i % 3):
            msgs += [
                {"role": "user", "content": words(rng, 5)},
                {"role": "assistant", "content": words(rng, 3)},
            ]
        row = {"messages": msgs}
        if i % 4 == 3:  # a tool call, its response, and a reasoning turn after it
            msgs += [
                {"role": "user", "content": "weather in " + words(rng, 1)},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "oslo"}},
                        }
                    ],
                },
                {"role": "tool", "content": words(rng, 2)},
                {"role": "assistant", "content": words(rng, 3), "reasoning_content": words(rng, 4)},
            ]
            row["tools"] = TOOLS
        if i % 4 == 1:
            msgs[-1]["reasoning_content"] = words(rng, 3)  # the last turn thinks
        rows.append(row)
    return rows


def short(rng, n: int) -> list[dict]:
    """n one-exchange conversations of 20-40 tokens (train.py's rows)."""
    out = []
    for _ in range(n):
        msgs = [
            {"role": "user", "content": words(rng, int(rng.integers(2, 8)))},
            {"role": "assistant", "content": words(rng, int(rng.integers(1, 6)))},
        ]
        out.append({"messages": msgs})
    return out


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("chat_tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS), "user assistant system tool get_weather city arguments name"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = QWEN3_STYLE
    fast.save_pretrained(d)
    return str(d)


def reference_counted(tok, ids: np.ndarray) -> np.ndarray:
    """Token-id reference: after each assistant header's ids, every id through "<|im_end|>"."""
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids, counted, n = ids.tolist(), np.zeros(len(ids), dtype=np.uint8), len(header)
    for p in range(len(ids) - n + 1):
        if ids[p : p + n] == header:
            q = p + n
            while ids[q] != end:
                counted[q] = 1
                q += 1
            counted[q] = 1
    return counted


def test_counted_labels_equal_a_token_id_reference(tok_dir):
    """The Qwen3-style template on multi-turn rows with a system prompt, reasoning, a tool call
    and its response: every counted token is the reference's, the separator last and not
    counted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    render = Renderer(tok_dir)
    assert render.rule == "chatml" and render.sep == tok.convert_tokens_to_ids("<|endoftext|>")
    said = []  # the counted tokens of each row, as text
    for i, row in enumerate(varied(np.random.default_rng(0))):
        doc = render(row, f"row {i}")
        text = tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False)
        assert doc.ids[:-1].tolist() == tok(text, add_special_tokens=False)["input_ids"]
        assert doc.ids[-1] == render.sep and doc.counted[-1] == 0
        want = reference_counted(tok, doc.ids[:-1])
        assert np.array_equal(doc.counted[:-1], want), (row, doc.counted, want)
        turns = sum(m["role"] == "assistant" for m in row["messages"])
        assert doc.counted.sum() > 2 * turns  # every assistant turn holds counted tokens
        said.append(tok.decode(doc.ids[doc.counted == 1]))
    # reasoning and tool calls count as rendered inside the turn; a tool's response does not
    assert any("<think>" in t for t in said) and any("<tool_call>" in t for t in said)
    assert not any("<tool_response>" in t or "<|im_start|>" in t for t in said)


def test_generation_markers_count_what_they_mark(tok_dir, tmp_path):
    """A template with {% generation %}: the counted tokens are transformers' assistant mask,
    here the same tokens as the reference's."""
    from transformers import AutoTokenizer

    (tmp_path / "marked.jinja").write_text(MARKED)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    render = Renderer(tok_dir, str(tmp_path / "marked.jinja"))
    assert render.rule == "generation"
    for i, row in enumerate(short(np.random.default_rng(1), 4)):
        doc = render(row, f"row {i}")
        assert np.array_equal(doc.counted[:-1], reference_counted(tok, doc.ids[:-1]))


def test_prompt_completion_counts_the_completion_and_its_stop(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    render = Renderer(tok_dir)
    doc = render({"prompt": "the ship", "completion": " sailed north"}, "row 1")
    completion = tok(" sailed north", add_special_tokens=False)["input_ids"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    counted = doc.ids[doc.counted == 1].tolist()
    assert counted == completion + [eos] and doc.ids[-1] == render.sep
    pair = {
        "prompt": [{"role": "user", "content": "yes"}],
        "completion": [{"role": "assistant", "content": "no"}],
    }
    doc = render(pair, "row 2")
    # The prompt's own rendering (with the generation prompt, "<think>\n" included) is a
    # prefix of the whole one's ids; counted: the rest through the last "<|im_end|>".
    head = tok.apply_chat_template(pair["prompt"], tokenize=False, add_generation_prompt=True)
    n = len(tok(head, add_special_tokens=False)["input_ids"])
    assert doc.counted[:n].sum() == 0 and doc.counted[n:-2].all()
    assert tok.decode(doc.ids[doc.counted == 1]) == "\n</think>\n\nno<|im_end|>"


def test_bad_rows_are_refused_in_one_line(tok_dir, tmp_path):
    render = Renderer(tok_dir)
    odd = [{"role": "user", "content": "yes"}, {"role": "narrator", "content": "north"}]
    with pytest.raises(DataError, match=r"row 3: role 'narrator' \(message 2\) is not one"):
        render({"messages": odd}, "row 3")
    with pytest.raises(
        DataError,
        match=r"row 4: none of the three forms: no 'text' column, .* \(it has \['question'\]\)",
    ):
        render({"question": "x"}, "row 4")
    assert render({"messages": [{"role": "user", "content": "x"}]}, "r").left_out
    inline = {"role": "assistant", "content": "<think>\ncold\n</think>\n\nno"}  # the template
    later = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    doc = render({"messages": [odd[0], inline, *later]}, "row 5")  # drops inline reasoning
    assert doc.counted.sum() > 0 and not doc.left_out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{"messages": [\n')
    assert data_kind(str(bad)) == "conversations"
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(DataError, match=r"t.jinja: neither \{% generation %\} markers nor"):
        Renderer(tok_dir, str(tmp_path / "t.jinja"))


def test_rows_keep_conversations_whole_and_leave_longer_ones_out(tok_dir, tmp_path):
    """Best fit of whole conversations: every conversation that fits is in some row whole with its
    mask; one longer than a row is left out and counted, never cut; the cache keys on the
    template (another template, another cache) and stores the mask beside the ids."""
    rng = np.random.default_rng(2)
    rows = short(rng, 30)
    rows[5]["messages"][1]["content"] = words(rng, 200)  # longer than a row
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    cache = str(tmp_path / "cache")
    built = build_rows(path, tok_dir, 127, 4, cache_dir=cache, pack="best-fit", progress=False)
    assert built.meta["left_out"] == {"longer than a row of 128": 1}
    assert built.counted.dtype == np.uint8 and built.counted.shape == built.tokens.shape
    render = Renderer(tok_dir)
    docs = [render(r, "") for r in rows]
    flat = [(r.tolist(), m.tolist()) for r, m in zip(built.tokens, built.counted, strict=True)]
    placed = 0
    for i, doc in enumerate(docs):
        ids, counted = doc.ids.tolist(), doc.counted.tolist()
        where = [_find(r, ids) for r, _ in flat]
        if i == 5:
            assert all(w < 0 for w in where) and not any(_find(r, ids[:20]) >= 0 for r, _ in flat)
            continue
        for (_, m), w in zip(flat, where, strict=True):
            if w >= 0:
                assert m[w : w + len(ids)] == counted
                placed += 1
                break
    assert placed == built.meta["documents"] > 10
    assert built.predictable(0).tolist() == (built.counted[0][1:] != 0).tolist()
    (tmp_path / "marked.jinja").write_text(MARKED)
    other = build_rows(
        path,
        tok_dir,
        127,
        4,
        cache_dir=cache,
        chat_template=str(tmp_path / "marked.jinja"),
        progress=False,
    )
    assert other.path != built.path and other.built
    again = build_rows(path, tok_dir, 127, 4, cache_dir=cache, progress=False)
    assert again.path == built.path and not again.built
    assert os.path.exists(built.path.replace(".npy", ".mask.npy"))


def _find(row: list, piece: list) -> int:
    n = len(piece)
    return next((i for i in range(len(row) - n + 1) if row[i : i + n] == piece), -1)


# ---- train.py on conversations ----------------------------------------------------------------
T = 96  # rows of 96 + 1 ids: two or three conversations each


@pytest.fixture(scope="module")
def run_setup(tok_dir, tmp_path_factory):
    """A model directory with the tokenizer beside the weights, and a .jsonl of conversations."""
    import shutil

    d = tmp_path_factory.mktemp("chat_train")
    ref = hf_model(replace(CFG, vocab_size=320), seed=3)
    save_hf(ref, str(d / "model"))
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), d / "model" / f)
    write_jsonl(d / "chats.jsonl", short(np.random.default_rng(5), 40))
    write_jsonl(d / "held.jsonl", short(np.random.default_rng(6), 20))
    return d, ref


def chat_flags(d, out, *extra) -> list[str]:
    flags = _common(d, out, seq_len=T)
    flags[flags.index("--data") + 1] = str(d / "chats.jsonl")
    return [*flags, "--cache-dir", str(d / "cache"), "--eval-every", "0", *extra]


def per_conversation_reference(ref, rows, counted, sep) -> tuple[float, float, int]:
    """transformers on each conversation of the rows alone (positions from 0), the loss summed
    over the labels the mask counts and divided by their count, and its gradient norm."""
    ref.zero_grad()
    loss_sum, count = 0.0, 0
    for row, mask in zip(rows, counted, strict=True):
        ends = np.flatnonzero(row == sep) + 1
        start = 0
        for end in ends:
            ids = torch.as_tensor(row[start:end].astype(np.int64))  # the conversation, its sep
            keep = torch.as_tensor(mask[start + 1 : end] != 0)  # its labels' flags
            if keep.any():
                logits = ref(ids[None, :-1]).logits[0]
                labels = ids[1:]
                loss_sum = loss_sum + F.cross_entropy(logits[keep], labels[keep], reduction="sum")
                count += int(keep.sum())
            start = end
    loss = loss_sum / count
    loss.backward()
    norm = torch.norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    return loss.item(), norm.item(), count


@pytest.mark.slow
def test_packed_conversations_match_transformers_on_each_alone(run_setup):
    """The first step's loss and grad norm on two rows of packed conversations, some spanning
    the sp 2 and sp 4 shard boundaries: 1 process, sp 2, sp 4 (kv heads repeated), dp 2 x sp 2;
    and the held-out loss (--eval-data, the same form) at step 0, at 1 process."""
    d, ref = run_setup
    out = d / "1proc"
    held = ["--eval-data", str(d / "held.jsonl"), "--eval-rows", "2", "--eval-every", "-1"]
    p = run_train(1, *chat_flags(d, out, "--sp", "1", "--grad-accum", "2", *held))
    cache = str(d / "cache")
    rows = build_rows(str(d / "chats.jsonl"), str(d / "model"), T, 2, cache_dir=cache)
    sep = rows.meta["eos_id"]
    # the held-out loss before the step counts the same labels: transformers' on the held rows
    h = build_rows(str(d / "held.jsonl"), str(d / "model"), T, 2, cache_dir=cache)
    eval_loss, _, eval_count = per_conversation_reference(ref, h.tokens, h.counted, sep)
    first = eval_records(out)[0]
    print(f"held-out at step 0: {first['eval_loss']:.8f} (transformers {eval_loss:.8f})")
    assert first["eval_tokens"] == eval_count
    assert first["eval_loss"] == pytest.approx(eval_loss, rel=1e-6)
    assert "data: " in p.stdout and "rows read packed whole" in p.stdout, p.stdout
    bounds = [np.flatnonzero(r == sep) for r in rows.tokens]
    spans = set()  # the shard boundaries some conversation spans
    for ends in bounds:
        for start, end in zip([0, *(ends[:-1] + 1)], ends, strict=True):
            spans |= {b for b in (24, 48, 72) if start < b <= end}
    assert {24, 48} <= spans or {48, 72} <= spans  # sp 4's and sp 2's boundaries inside some
    loss, norm, count = per_conversation_reference(ref, rows.tokens, rows.counted, sep)
    runs = {
        "1proc": None,
        "sp2": (2, ["--sp", "2", "--grad-accum", "2"]),
        "sp4-kv-repeat": (4, ["--sp", "4", "--grad-accum", "2"]),
        "dp2xsp2": (4, ["--sp", "2"]),
    }
    for name, launch in runs.items():
        if launch:
            run_train(launch[0], *chat_flags(d, d / name, *launch[1]))
        m = metrics(d / name)[0]
        print(
            f"{name}: loss {m['loss']:.8f} (transformers per conversation {loss:.8f}), "
            f"grad_norm {m['grad_norm']:.8f} ({norm:.8f}), {m['tokens']} labels"
        )
        assert m["tokens"] == count
        assert m["loss"] == pytest.approx(loss, rel=1e-6)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-6)


def no_label_counts(*_):
    """Patched into train.py's ranks: the rows mark no label (a step with nothing to learn)."""
    from data.rows import MaskedRows

    MaskedRows.predictable = lambda self, i: np.zeros(self.seq_len, dtype=bool)


def test_a_step_without_counted_labels_says_so(run_setup, tmp_path):
    d, _ = run_setup
    out = tmp_path / "o"
    p = run_train(1, *chat_flags(d, out, "--sp", "1"), setup=no_label_counts)
    (m,) = metrics(out)
    assert m["no_counted_labels"] and m["loss"] is None and m["tokens"] == 0
    assert "no counted labels in this step's rows: no loss, weights unchanged" in p.stdout


def test_bad_input_is_refused_in_one_line_before_the_weights(run_setup, tmp_path):
    d, _ = run_setup
    user = {"role": "user", "content": "yes"}
    cases = {
        "form": ([{"question": "yes"}], "chats.jsonl:1: none of the three forms"),
        "role": (
            [{"messages": [user, {"role": "narrator", "content": "no"}]}],
            "chats.jsonl:1: role 'narrator' (message 2) is not one",
        ),
        "no-assistant": (
            [{"messages": [user]}] * 3,
            "every row is left out (3 no assistant turn)",
        ),
        "json": (None, "chats.jsonl:2: malformed JSON"),
        "template": ([{"messages": [user]}], "neither {% generation %} markers nor"),
    }
    for name, (rows, said) in cases.items():
        data = tmp_path / name / "chats.jsonl"
        data.parent.mkdir()
        if rows is None:
            data.write_text('{"messages": [{"role": "user", "content": "x"}]}\n{"messages": [\n')
        else:
            write_jsonl(data, rows)
        flags = chat_flags(d, tmp_path / name / "o", "--check-only")
        flags[flags.index("--data") + 1] = str(data)
        if name == "template":
            (tmp_path / "plain.jinja").write_text(
                "{% for m in messages %}{{ m.content }}{% endfor %}"
            )
            flags += ["--chat-template", str(tmp_path / "plain.jinja")]
        p = run_train(1, *flags, check=False)
        lines = p.stderr.strip().splitlines()
        print(name, lines)
        assert p.returncode == 2 and len(lines) == 1 and said in lines[0], (name, p.stderr)


def test_parquet_and_json_rows_read_as_the_jsonl(tmp_path):
    """The same rows from .jsonl, a .json list and .parquet (whose schema fills missing keys with
    None, left out again): the same records in the same seeded order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.conversations import iter_records

    rows = varied(np.random.default_rng(3))[3:7]  # the first with tools: pyarrow's
    # from_pylist takes its columns from the first row
    for r in rows:  # parquet needs one type per field: tool arguments as a JSON string
        for m in r["messages"]:
            for call in m.get("tool_calls", []):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    got = {}
    for name in ("a.jsonl", "b.json", "c.parquet"):
        path = str(tmp_path / name)
        assert data_kind(path) == "conversations"
        got[name] = [r for _, r in iter_records(path, seed=1)]
    assert got["a.jsonl"] == got["b.json"] == got["c.parquet"]


def test_hub_conversations_read_as_the_same_local_rows(tok_dir, tmp_path, monkeypatch):
    """An hf: dataset of conversations (datasets' loader monkeypatched: nothing reaches the hub)
    is conversational and packs into the same ids and mask as a .jsonl of the same rows, when
    the stream's shuffle gives the rows in the order the local file's permutation visits them."""
    import datasets
    import huggingface_hub

    from data import sources

    rows = short(np.random.default_rng(7), 12)
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    order = np.random.default_rng(4).permutation(len(rows))

    class FakeStream:
        def shuffle(self, seed, buffer_size):
            self.seed = seed
            return self

        def __iter__(self):
            return iter([rows[i] for i in order] if self.seed == 4 else rows)

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: FakeStream())
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, repo_id, **kw: None)
    sources.hub_problem.cache_clear()  # asked once per process: this test's hub answers
    source = "hf:someone/chats-for-a-test:train"
    assert data_kind(source) == "conversations"
    opts = dict(cache_dir=str(tmp_path / "cache"), seed=4, progress=False)
    hub = build_rows(source, tok_dir, 63, 3, **opts)
    local = build_rows(path, tok_dir, 63, 3, **opts)
    assert hub.meta["counted_labels"] > 0 and hub.path != local.path
    assert (hub.tokens == local.tokens).all() and (hub.counted == local.counted).all()
    sources.hub_problem.cache_clear()


def test_dry_run_prints_the_starts_data_line(run_setup, tmp_path, capsys, monkeypatch):
    """--dry-run on local conversations renders and packs them into the token cache as the run's
    checks do and prints the data line the run's start prints: the run then reads that cache
    (not built again) and its line is the dry run's; the counted labels are the cached mask's."""
    import re

    import train
    from run.console import describe_rows

    d, _ = run_setup
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    flags = chat_flags(d, tmp_path / "o", "--sp", "1", "--dry-run")
    flags[flags.index("--cache-dir") + 1] = str(tmp_path / "cache")
    train.main(flags)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("data: ")]
    cfg = train.parse_args(flags)
    rows_needed = cfg.steps * cfg.grad_accum * 2  # dp 2
    rows = build_rows(
        str(d / "chats.jsonl"),
        str(d / "model"),
        T,
        rows_needed,
        cache_dir=str(tmp_path / "cache"),
        progress=False,
    )
    assert not rows.built and line == [describe_rows(rows.meta)]
    print(line[0])
    counted = int(re.search(r"the loss counts ([\d,]+) tokens", line[0])[1].replace(",", ""))
    assert counted == int(rows.counted.sum()) > 0
    assert f"into {rows_needed} rows of {T + 1} tokens" in line[0]
