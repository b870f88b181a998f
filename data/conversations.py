"""Conversations and prompt-completion rows: rendered with the chat template, a loss mask beside.

    kind = data_kind("/data/chats.jsonl")       # "text", "conversations" or "prompt-completion"
    render = Renderer(tokenizer, template_path="", eos_token=None)   # --chat-template, --eos-token
    for where, record in iter_records("/data/chats.jsonl", seed=0):
        doc = render(record, where)   # ids uint32 [n], counted uint8 [n]; or .left_out says why

A source's rows are told apart by their fields, as TRL does: {"text": ...} is text (data/sources.py
reads it), {"messages": [{"role", "content"}, ...]} a conversation (optional "reasoning_content"
and "tool_calls" in a message, "tools" in the row), {"prompt", "completion"} a prompt-completion
pair (two strings, or two message lists). The first row decides the source's kind, for local
files (.jsonl, .json, .parquet, a directory of them) and "hf:owner/name[:split]" hub datasets.

A conversation is rendered once, whole, by the model's own chat template, as at inference
(add_generation_prompt=False), and tokenised once. counted[j] = 1 when token j is a label the
loss counts: each assistant turn's tokens after its header through its end-of-turn token
(Qwen3's "<|im_start|>assistant\\n" ... "<|im_end|>"); the newline after "<|im_end|>" is not
counted, nor is anything outside assistant turns. Reasoning and tool calls count as the template
renders them inside the turn. Where the turns are: the template's {% generation %} markers when
it has them (transformers' return_assistant_tokens_mask), else the ChatML header, whose text
spans are mapped to tokens through the tokenizer's offsets (a token counts when it starts inside
a span); any other template is refused. A prompt-completion pair counts the completion: for
strings, prompt + completion tokenised together, the tokens starting in the completion, then the
eos token (counted: the model learns to stop); for message lists, what the whole conversation
renders after the prompt's rendering with the generation prompt, through the last end-of-turn.

Every document then ends with the separator (--eos-token, else the tokenizer's pad token, else
its eos), never counted, which data/documents.py splits rows at: it must not occur inside a
rendered conversation. Bad input raises DataError: one line naming the file and row.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from data import encode, sources
from model.config import ConfigError

__all__ = ["DataError", "Document", "Renderer", "data_kind", "iter_records", "row_form"]

KINDS = {"conversation": "conversations", "prompt-completion": "prompt-completion"}
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
CHATML_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


class DataError(ConfigError):
    """Input the run cannot train on; one line naming the file and row (exit 2, train.py)."""


def row_form(record: Any) -> str | None:
    """A record's form by its fields: "text", "conversation", "prompt-completion"; else None."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("messages"), list):
        return "conversation"
    if "prompt" in record and "completion" in record:
        return "prompt-completion"
    if isinstance(record.get("text"), str):
        return "text"
    return None


def _json_records(path: str) -> list[tuple[str, Any]]:
    """(file:row, raw line or parsed record) of a .jsonl or .json file; lines are parsed later."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            return [(f"{path}:{i + 1}", r) for i, r in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
    lines = text.splitlines()
    return [(f"{path}:{i + 1}", line) for i, line in enumerate(lines) if line.strip()]


def _parse(where: str, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None


def _file_records(path: str) -> list[tuple[str, Any]]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [(f"{path}:{i + 1}", _drop_nones(r)) for i, r in enumerate(rows)]
    return _json_records(path)


def _drop_nones(obj: Any) -> Any:
    """A parquet row as JSON would have it: the keys its schema filled with None left out."""
    if isinstance(obj, dict):
        return {k: _drop_nones(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_nones(v) for v in obj]
    return obj


def data_kind(source: str, text_column: str = "text") -> str:
    """The kind of a source, "text", "conversations" or "prompt-completion": its first row's form
    for a local .jsonl, .json or .parquet or an hf: hub dataset (a row with `text_column` is
    text); else text (pg19, .txt files, token ids, a hub that does not answer)."""
    if source.startswith("hf:"):
        where, record = _first_hub_record(source)
        if record is None:
            return "text"  # check_data says the hub does not answer
    elif sources.is_hub_source(source) or source.startswith(("synthetic:", "tokens:")):
        return "text"
    else:
        try:
            files, builder = sources.local_files(source)
        except (FileNotFoundError, ValueError):
            return "text"  # check_data says what is wrong with it
        if builder == "text":
            return "text"
        where, raw = _first_record(files[0])
        record = _parse(where, raw)
    form = row_form(record)
    if form is None and isinstance(record, dict) and text_column in record:
        return "text"
    if form is None:
        raise DataError(f"{where}: {_no_form(record, text_column)}")
    return KINDS.get(form, "text")


def _first_record(path: str) -> tuple[str, Any]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        first = pq.ParquetFile(path).read_row_group(0).slice(0, 1).to_pylist()
        return f"{path}:1", _drop_nones(first[0]) if first else {}
    if path.endswith(".jsonl"):  # the first line alone: a corpus may be gigabytes
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if line.strip():
                    return f"{path}:{i + 1}", line
        raise DataError(f"{path}: no rows")
    records = _json_records(path)
    if not records:
        raise DataError(f"{path}: no rows")
    return records[0]


@functools.lru_cache(maxsize=8)  # the checks ask a source's kind several times: stream once
def _first_hub_record(source: str) -> tuple[str, Any]:
    """("SOURCE row 1", the first row of the hub's stream), or (.., None) if the hub is silent."""
    if sources.hub_problem(sources.hub_id_and_split(source)[0]):  # fails in seconds, not 30
        return f"{source} row 1", None
    try:
        return f"{source} row 1", _drop_nones(next(sources.hub_rows(source, seed=0)))
    except (RuntimeError, StopIteration):
        return f"{source} row 1", None


def _no_form(record: Any, text_column: str = "text") -> str:
    fields = sorted(record) if isinstance(record, dict) else type(record).__name__
    return (
        f"none of the three forms: no {text_column!r} column, no 'messages' (a list of role and "
        f"content), no 'prompt' and 'completion' (it has {fields})"
    )


def iter_records(source: str, seed: int) -> Iterator[tuple[str, dict]]:
    """(file:row, record) of every row of a local source, in the order
    np.random.default_rng(seed).permutation(rows) (as data/sources.py orders text); of a hub
    source ("SOURCE row N"), in the stream's seeded shuffle order (data/sources.py's hub_rows)."""
    if sources.is_hub_source(source):
        for i, row in enumerate(sources.hub_rows(source, seed)):
            yield f"{source} row {i + 1}", _drop_nones(row)
        return
    files, _ = sources.local_files(source)
    records = [r for f in files for r in _file_records(f)]
    for i in np.random.default_rng(seed).permutation(len(records)):
        where, raw = records[i]
        yield where, _parse(where, raw)


@dataclass
class Document:
    """One row's tokens: ids uint32 [n] and counted uint8 [n] (1: its label counts), or the
    reason it is left out ("no assistant turn"), ids then empty."""

    ids: np.ndarray
    counted: np.ndarray
    left_out: str = ""


class Renderer:
    """Turns records into Documents (see the module docstring); its `key` is what the token cache
    keys on: the template's hash, the mask rule and the separator."""

    def __init__(self, tokenizer: Any, template_path: str = "", eos_token: str | None = None):
        self.tok = encode.load_tokenizer(tokenizer)
        self.encoder = encode.encoder_for(self.tok)
        self.template_name = template_path or "the tokenizer's chat_template"
        self.template = _read_template(self.tok, template_path)
        self.rule = mask_rule(self.template, self.template_name) if self.template else None
        sep = eos_token or self.tok.pad_token or self.tok.eos_token
        self.sep = encode.eos_id(self.tok, sep)
        self.eos = encode.eos_id(self.tok, eos_token)

    @property
    def key(self) -> dict[str, Any]:
        digest = hashlib.sha256((self.template or "").encode()).hexdigest()
        return {"chat_template": digest, "mask_rule": self.rule, "separator": self.sep}

    def __call__(self, record: Any, where: str) -> Document:
        form = row_form(record)
        if form == "conversation":
            ids, counted = self._conversation(record, where)
        elif form == "prompt-completion":
            ids, counted = self._prompt_completion(record, where)
        elif form == "text":
            raise DataError(f"{where}: a text row among conversations; one kind per source")
        else:
            raise DataError(f"{where}: {_no_form(record)}")
        if not counted.any():
            return Document(ids[:0], counted[:0], "no assistant turn")
        ends = ids.size > 0 and ids[-1] == self.sep  # a string completion's eos, the separator
        if (ids[: ids.size - ends] == self.sep).any():
            raise DataError(
                f"{where}: the separator id {self.sep} occurs inside the rendered row; pass "
                f"--eos-token with a token no row holds (Qwen3: <|endoftext|>)"
            )
        if ends:
            return Document(ids, counted.astype(np.uint8))
        return Document(np.append(ids, self.sep), np.append(counted, 0).astype(np.uint8))

    def _needs_template(self, where: str) -> str:
        if not self.template:
            raise DataError(
                f"{where}: messages need a chat template and the tokenizer has none; pass "
                f"--chat-template FILE.jinja"
            )
        return self.template

    def _check_roles(self, messages: list, text: str, where: str) -> None:
        """Every message's content but the assistant's (which templates may rewrite: Qwen3's
        drops the reasoning of earlier turns) is in the rendered text, in order: a role the
        template does not know is dropped (Qwen3's) or raises, never trained on silently."""
        at = 0
        for k, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(role, str):
                raise DataError(f"{where}: message {k + 1} has no role (a dict with role, content)")
            if role == "assistant" or not isinstance(content, str) or not content.strip():
                continue
            found = text.find(content.strip(), at)
            if found < 0:
                raise DataError(
                    f"{where}: role {role!r} (message {k + 1}) is not one {self.template_name} "
                    f"renders: its content is not in the rendered text"
                )
            at = found + len(content.strip())

    def _render(self, messages, tools, where: str, **kw) -> str:
        try:
            return self.tok.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self._needs_template(where),
                tokenize=False,
                **kw,
            )
        except DataError:
            raise
        except Exception as e:  # jinja's raise_exception, a missing field
            raise DataError(f"{where}: {self.template_name} cannot render it ({e})") from None

    def _conversation(self, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        messages, tools = record["messages"], record.get("tools")
        text = self._render(messages, tools, where, add_generation_prompt=False)
        self._check_roles(messages, text, where)
        if self.rule == "generation":
            self._needs_template(where)
            out = self.tok.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            ids = np.asarray(out["input_ids"], dtype=np.uint32)
            return ids, np.asarray(out["assistant_masks"], dtype=np.uint8)
        spans = [(m.start(1), m.end(1)) for m in CHATML_TURN.finditer(text)]
        return self._tokens(text, spans)

    def _prompt_completion(self, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            ids, counted = self._tokens(prompt + completion, [(len(prompt), None)])
            return np.append(ids, self.eos), np.append(counted, 1)
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise DataError(f"{where}: prompt and completion must be two strings or two lists")
        tools = record.get("tools")
        head = self._render(prompt, tools, where, add_generation_prompt=True)
        whole = self._render(prompt + completion, tools, where, add_generation_prompt=False)
        self._check_roles(prompt + completion, whole, where)
        if not whole.startswith(head):
            raise DataError(
                f"{where}: {self.template_name} renders the prompt differently with the "
                f"completion after it; the completion's tokens cannot be found"
            )
        return self._tokens(whole, [(len(head), len(whole.rstrip("\n")))])

    def _tokens(self, text: str, spans: list) -> tuple[np.ndarray, np.ndarray]:
        """text tokenised once; counted: the tokens that start inside a span [a, b) (b None:
        the end) of the text's characters."""
        enc = self.encoder.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.uint32)
        starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64)
        counted = np.zeros(ids.size, dtype=np.uint8)
        for a, b in spans:
            inside = starts >= a if b is None else (starts >= a) & (starts < b)
            counted[inside] = 1
        return ids, counted


def _read_template(tok: Any, path: str) -> str | None:
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise DataError(f"--chat-template {path}: {e.strerror}") from None
    template = getattr(tok, "chat_template", None)
    return template if isinstance(template, str) else None


def mask_rule(template: str, name: str) -> str:
    """The rule that finds the assistant's tokens: "generation" (the template marks them) or
    "chatml" (its assistant header is ChatML's); any other template is refused in one line."""
    if GENERATION_MARKER.search(template):
        return "generation"
    if "<|im_start|>" in template and "<|im_end|>" in template and "assistant" in template:
        return "chatml"
    raise DataError(
        f"{name}: neither {{% generation %}} markers nor ChatML's <|im_start|>assistant header: "
        f"the assistant's tokens cannot be found; pass --chat-template FILE.jinja with "
        f"{{% generation %}} ... {{% endgeneration %}} around each assistant turn"
    )


MASK_BIT = np.uint32(1 << 31)  # a counted token's id carries this bit through the packer


def pack_conversations(
    render: Renderer, records, out: np.ndarray, mask_out: np.ndarray, *, desc: str
) -> dict[str, Any]:
    """Fill `out` [rows, row_len] with whole rendered rows (data/packing.py's best fit, padded
    with the separator) and `mask_out` with their counted flags. A row longer than row_len is
    left out, never cut, and counted with the rows without an assistant turn. Returns the counts
    for the cache's JSON and the start's line; refuses data whose rows all are left out."""
    from data.encode import NotEnoughText
    from data.packing import BUFFER_ROWS, BestFit

    rows, row_len = out.shape
    left_out: dict[str, int] = {}
    seen = {"rows": 0, "tokens": 0}

    def documents():
        for where, record in records:
            seen["rows"] += 1
            doc = render(record, where)
            why = doc.left_out or (
                f"longer than a row of {row_len:,}" if doc.ids.size > row_len else ""
            )
            if why:
                left_out[why] = left_out.get(why, 0) + 1
                continue
            seen["tokens"] += doc.ids.size
            yield doc.ids | (doc.counted.astype(np.uint32) * MASK_BIT)

    packer = BestFit(row_len, pad_id=render.sep, buffer_tokens=BUFFER_ROWS * row_len)
    filled = 0
    for row in packer.rows(documents()):
        out[filled] = row & ~MASK_BIT
        mask_out[filled] = (row >> 31).astype(np.uint8)
        filled += 1
        if filled == rows:
            break
    packed = seen["rows"] - sum(left_out.values())
    if packed == 0:
        reasons = ", ".join(f"{n} {why}" for why, n in left_out.items()) or "no rows"
        raise DataError(f"{desc}: every row is left out ({reasons}); nothing to train on")
    if filled < rows:
        raise NotEnoughText(seen["tokens"], out.shape, packed, desc)
    counted = int(mask_out.sum(dtype=np.int64))
    ends = (out[:, 1:] == render.sep) & (out[:, :-1] != render.sep)  # each one's last id
    return {
        "documents": int(ends.sum(dtype=np.int64)),  # in the rows (the buffer read more)
        "conversations_read": seen["rows"],
        "left_out": left_out,
        "counted_share": round(counted / out.size, 6),
        "counted_labels": counted,
        "pack": "best-fit",
        "padding_share": round(packer.padding_share, 6),
        "documents_cut": 0,
    }
