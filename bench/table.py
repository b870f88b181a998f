"""The one text table of the benchmarks' printouts: a list of dicts, one column per key.

    from bench.table import table
    print(table(rows, {"impl": "", "time_s": ".3f", "peak_mem_gb": ".2f"}))

Headers are the keys (the JSON's field names); a missing or None value prints as "-".
"""


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list, columns: dict) -> str:
    """columns: key -> format spec. The first column is left-aligned, the others right-aligned."""
    cells = [list(columns)] + [[_cell(r.get(k), spec) for k, spec in columns.items()] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    for row in cells:
        first = row[0].ljust(widths[0])
        lines.append(
            "  ".join([first] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)])
        )
    return "\n".join(lines)
