"""The benchmarks' printouts: a table of dicts (one column per key), or one dict's figures.

    from bench.table import figures, table
    print(table(rows, {"impl": "", "time_s": ".3f", "peak_mem_gb": ".2f"}))
    print(figures(result))    # time_s=0.0123, runs.0.peak_gib=1.5, ...

Headers and names are the keys, the JSON's field names; a missing or None value prints as "-".
"""


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list, columns: dict) -> str:
    """columns: key -> format spec; "" (text) is left-aligned, numbers are right-aligned."""
    cells = [list(columns)] + [[_cell(r.get(k), spec) for k, spec in columns.items()] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    align = [str.ljust if spec == "" else str.rjust for spec in columns.values()]
    return "\n".join(
        "  ".join(a(c, w) for a, c, w in zip(align, row, widths, strict=True)) for row in cells
    )


def figures(d: dict, prefix: str = "") -> str:
    """Every number, string and flag in `d` as key=value, nested keys dotted, floats to 4 digits."""
    out = []
    for k, v in d.items():
        if isinstance(v, list) and all(isinstance(x, dict) for x in v):
            v = dict(enumerate(v))
        if isinstance(v, dict):
            out.append(figures(v, f"{prefix}{k}."))
        elif isinstance(v, float):
            out.append(f"{prefix}{k}={v:.4g}")
        elif isinstance(v, (int, str, bool)) or v is None:
            out.append(f"{prefix}{k}={v}")
    return ", ".join(x for x in out if x)
