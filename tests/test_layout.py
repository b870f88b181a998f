"""The repository's shape, for readers who copy single files: what each package may import, that
every copyable file opens with a usage example, how long functions get, and that product code
speaks of the project as it is (no history, no test-only switches)."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("bench", "data", "loss", "memory", "model", "run")


def python_files(*dirs: str) -> list[str]:
    found = []
    for d in dirs:
        for name in sorted(os.listdir(os.path.join(ROOT, d))):
            if name.endswith(".py"):
                found.append(os.path.join(d, name))
    return found


def product_files() -> list[str]:
    return ["train.py", *python_files(*PACKAGES)]


def parse(path: str) -> ast.Module:
    with open(os.path.join(ROOT, path)) as f:
        return ast.parse(f.read(), path)


def imported_packages(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def code_lines(path: str) -> int:
    with open(os.path.join(ROOT, path)) as f:
        return sum(1 for line in f if line.strip())


@pytest.mark.parametrize("path", python_files("model", "loss"))
def test_model_and_loss_stand_alone_and_open_with_usage(path):
    """model/ and loss/ are what people copy: they import nothing of the trainer around them."""
    tree = parse(path)
    assert not imported_packages(tree) & {"run", "memory", "data", "bench", "train"}, path
    doc = ast.get_docstring(tree, clean=False)
    if os.path.basename(path) == "__init__.py" and not doc:
        return
    assert doc, f"{path} has no module docstring"
    # A usage example is an indented line of Python in the docstring's opening paragraphs (an
    # indented formula or diagram is not one).
    opening = [line for line in doc.splitlines()[:25] if line.startswith("    ") and line.strip()]
    assert any(is_python(line.strip()) for line in opening), f"{path} opens with no usage"


@pytest.mark.parametrize("path", python_files("model", "loss", "memory", "run", "data"))
def test_module_docstrings_are_at_most_45_lines(path):
    """A module docstring says what the file is for, how to use it and the one idea, in about 40
    lines; derivations live next to the code they explain or in docs/. Counted in the file, from
    the opening quotes to the closing ones."""
    tree = parse(path)
    if not ast.get_docstring(tree):
        return
    doc = tree.body[0]
    lines = doc.end_lineno - doc.lineno + 1
    assert lines <= 45, f"{path}: the module docstring is {lines} lines"


def is_python(line: str) -> bool:
    try:
        ast.parse(line)
    except SyntaxError:
        return False
    return True


def test_functions_in_model_loss_data_are_at_most_80_lines():
    long = []
    for path in python_files("model", "loss", "data"):
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_step_loop_fits_on_a_screen():
    train_fn = next(
        n
        for n in ast.walk(parse("train.py"))
        if isinstance(n, ast.FunctionDef) and n.name == "train"
    )
    loop = next(n for n in ast.walk(train_fn) if isinstance(n, ast.For))
    body = loop.body[-1].end_lineno - loop.body[0].lineno + 1
    assert body <= 60, f"train()'s step loop body is {body} lines"


def test_train_step_is_near_the_top_of_train_py():
    """A reader meets the step first: the flags live in run/train_config.py."""
    step = next(
        n
        for n in ast.walk(parse("train.py"))
        if isinstance(n, ast.FunctionDef) and n.name == "train_step"
    )
    assert step.lineno <= 200, f"train.py's train_step starts at line {step.lineno}"


def test_bench_is_at_most_12_percent_of_the_product():
    bench = sum(code_lines(p) for p in python_files("bench"))
    total = sum(code_lines(p) for p in product_files())
    assert bench / total <= 0.12, f"bench/ is {bench} of {total} non-blank lines"


HISTORY = [
    re.compile(r"\bissues? \d+", re.IGNORECASE),  # issue numbers
    re.compile(r"\bcommit [0-9a-f]{7,40}\b"),  # commit hashes
    re.compile(r"DESIGN\.md"),  # a document readers do not have
]


@pytest.mark.parametrize("path", [*product_files(), "README.md", "torchrun.sh"])
def test_product_speaks_of_the_project_as_it_is(path):
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    for pattern in HISTORY:
        assert not pattern.search(text), f"{path}: {pattern.search(text).group(0)!r}"
    # Failure injection lives in the tests (monkeypatching), not in variables product code reads.
    assert not re.search(r"environ[^\n]*TRAIN_(TEST|FAKE)", text), path


TOUR_ROW = re.compile(r"^\| `([^`]+)` \| .* \| (\d+) \|$", re.M)


def readme_between(start: str, end: str) -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return text[text.index(start) : text.index(end)]


def tour_rows() -> list[tuple[str, int]]:
    """README's file tour, the core and the rest: (path, lines) of each row
    `| \\`path\\` | what it is | lines |`."""
    tour = readme_between("<!-- tour -->", "<!-- /tour -->")
    return [(p, int(n)) for p, n in TOUR_ROW.findall(tour)]


def lines_of(path: str) -> int:
    with open(os.path.join(ROOT, path)) as f:
        return sum(1 for _ in f)


def test_readme_file_tour_line_counts_are_the_files():
    """Each file row's count is the file's line count; a directory row (`data/`, `bench/`)
    counts its .py files that have no row of their own. Every product file has a row, or is
    counted by its directory's (a package's empty or near-empty __init__.py needs neither)."""
    rows = tour_rows()
    named = {p for p, _ in rows}
    assert len(named) == len(rows), "a file has two rows in README's tour"
    assert {"train.py", "loss/chunked_ce.py", "memory/plan.py", "torchrun.sh"} <= named
    for path, n in rows:
        if path.endswith("/"):
            rest = [f for f in python_files(path.rstrip("/")) if f not in named]
            want = sum(lines_of(f) for f in rest)
        else:
            want = lines_of(path)
        assert n == want, f"README's tour says {path} has {n} lines; it has {want}"
    dirs = {p for p in named if p.endswith("/")}
    missing = [
        f
        for f in product_files()
        if f not in named
        and os.path.dirname(f) + "/" not in dirs
        and not (f.endswith("__init__.py") and lines_of(f) <= 2)
    ]
    assert not missing, f"README's tour has no row for {missing}"


CORE_MAX_LINES = 5000  # the method, readable in a sitting; the rest is the product around it


def test_readme_core_is_the_method_in_at_most_5000_lines():
    """The tour's first table, the core, names the files that teach the whole method, and they
    add up to at most CORE_MAX_LINES; everything else is in the rest."""
    core = dict(
        (p, int(n)) for p, n in TOUR_ROW.findall(readme_between("<!-- core -->", "<!-- /core -->"))
    )
    assert {
        "train.py",
        "model/qwen3.py",
        "loss/chunked_ce.py",
        "model/ulysses_exchange.py",
        "model/checkpoint_offload.py",
        "model/host_pool.py",
    } <= set(core), sorted(core)
    assert sum(core.values()) <= CORE_MAX_LINES, f"the core is {sum(core.values())} lines"


def test_readme_tests_section_is_at_most_10_lines():
    """How to run the suite and the quick subset; the timings live in docs/tests.md."""
    section = readme_between("## Tests\n", "\n## More").strip().splitlines()[1:]
    assert len(section) <= 10, f"README's Tests section is {len(section)} lines"


README_MAX_LINES = 350  # the commands, the tour, the glossary, headline numbers, then links


def test_readme_is_at_most_350_lines():
    """README is read first: what does not fit goes to a page under docs/ with a link."""
    n = lines_of("README.md")
    assert n <= README_MAX_LINES, f"README.md is {n} lines; move a section to docs/"


def markdown_pages() -> list[str]:
    docs = sorted(n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return ["README.md", *(f"docs/{n}" for n in docs)]


def relative_links(text: str) -> list[str]:
    """The targets of `[text](target)` and `![alt](target)` outside code, less web addresses."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # fenced code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code, such as `a[i](x)`
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # https:, mailto:


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchor of each heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", markdown_pages())
def test_every_relative_link_resolves(page):
    """Each relative link names a file that exists, and an anchor in a page names a heading."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    broken = []
    for link in relative_links(text):
        path, _, anchor = link.partition("#")
        target = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(ROOT, target)):
            broken.append(link)
        elif anchor and target.endswith(".md"):
            with open(os.path.join(ROOT, target)) as f:
                if anchor not in heading_anchors(f.read()):
                    broken.append(link)
    assert not broken, f"{page}: links to nothing: {broken}"


def run_imports(path: str) -> set[str]:
    """The run/ modules a run/ file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "run":
                found.update(f"run.{a.name}" for a in node.names)
            elif node.module.startswith("run."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("run."))
    return found - {path[:-3].replace("/", ".")}


def test_run_has_no_import_circle():
    """Read top to bottom, run/'s files form a tree of imports: no two of them need each other,
    however far apart (lazy imports inside functions count too)."""
    graph = {p[:-3].replace("/", "."): run_imports(p) for p in python_files("run")}

    def reaches(start: str, goal: str, seen: set) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not circles, f"run/ modules that import themselves through others: {circles}"


REPLAY_FILES = ("model/attention.py", "model/tiled_mlp.py", "model/checkpoint_offload.py")


def rebound_globals(path: str) -> set[str]:
    """Module-level names a function of `path` rebinds (its `global` statements)."""
    return {n for node in ast.walk(parse(path)) if isinstance(node, ast.Global) for n in node.names}


def test_a_replay_is_coordinated_by_objects_not_module_globals():
    """What a checkpoint's recompute does differently (the attention store's hand-back, the tiled
    MLP's skipped tiles, the prefetch) travels in model/checkpoint_offload.py's LayerReplay and the
    objects it hands on, never through a module-level variable: of the three files only
    attention.py rebinds two, the kernels set_backend and set_documents_kernel pin for the
    process, which no other file reads."""
    rebound = {path: rebound_globals(path) for path in REPLAY_FILES}
    assert rebound == {
        "model/attention.py": {"_PINNED", "_DOCUMENTS_PINNED"},
        "model/tiled_mlp.py": set(),
        "model/checkpoint_offload.py": set(),
    }, rebound
    for path in REPLAY_FILES:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for other, names in rebound.items():
            if other != path:
                assert not any(re.search(rf"\b{n}\b", text) for n in names), (path, names)
