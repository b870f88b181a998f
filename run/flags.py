"""A dataclass as command-line flags: one --flag per field, presets, and a run's config.json.

    cfg = parse_flags(TrainConfig, PRESETS, argv, description=__doc__)   # train.py's parse_args
    # python train.py --preset demo --steps 20 --no-save-final     (flags override the preset)
    # python train.py --config runs/demo/config.json               (the same run again)

Each field becomes --field-name (underscores as dashes); a field made with metadata {"help",
"choices"} gets that help line, ending in its default and choices; a bool field gets --x and
--no-x; a number field with metadata {"bare": value} takes that value when the flag comes
without one; a str field with metadata {"repeat": True} takes the flag several times, its values
joined by commas (--eval-task loss --eval-task passkey: "loss,passkey"). The value of a field
is, from weakest to strongest: the dataclass default, then --preset NAME (PRESETS[NAME] = (one
line, {field: value})) or --config FILE (a run's OUT/config.json: every field, so it reruns that
run), then the flags given. A bad flag or file ends in one line
and exit 2, like every other refusal of train.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from model.config import ConfigError

__all__ = ["parse_flags", "read_config_file"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other refusal (not usage + error)
        self.exit(2, f"error: {message}; see python train.py -h\n")


def add_field_flag(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    """--some-field for the field some_field, its help line ending in its default and choices."""
    help_text, choices = f.metadata.get("help", ""), f.metadata.get("choices")
    default = "unset" if f.default is None else repr(f.default)
    more = f"default: {default}"
    if choices:
        more += f"; one of {', '.join(choices)}"
    flag = "--" + f.name.replace("_", "-")
    if f.type.startswith("bool"):
        kind = dict(action=argparse.BooleanOptionalAction)
    elif f.metadata.get("repeat"):
        more += "; repeatable"
        kind = dict(action="append", metavar=f.name.upper(), choices=choices)
    else:
        value_type = {"int": int, "float": float}.get(f.type, str)
        kind = dict(type=value_type, metavar=f.name.upper(), choices=choices)
        if f.metadata.get("bare") is not None:  # the flag alone means this value
            kind.update(nargs="?", const=f.metadata["bare"])
    parser.add_argument(flag, default=None, help=f"{help_text} ({more})", **kind)


def read_config_file(cls, path: str) -> dict:
    """The fields of a run's OUT/config.json for dataclass `cls`, refused in one line if it is
    not one."""
    try:
        with open(path) as fh:
            fields = json.load(fh)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--config {path}: cannot read it ({e}); pass a run's OUT/config.json"
        ) from None
    known = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(fields) - known):
        raise ConfigError(
            f"--config {path}: unknown fields {', '.join(unknown)}; pass a run's OUT/config.json"
        )
    return fields


def parse_flags(cls, presets: dict, argv=None, *, description: str = ""):
    """An instance of dataclass `cls`: its defaults, then --preset or --config, then the flags."""
    preset_lines = "\n".join(f"  {name:<12} {line}" for name, (line, _) in presets.items())
    p = _Parser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets:\n" + preset_lines,
    )
    p.add_argument(
        "--preset", choices=sorted(presets), default=None, help="start from a preset (listed below)"
    )
    p.add_argument(
        "--config",
        default=None,
        help="start from a run's OUT/config.json: the same run (flags still override)",
    )
    for f in dataclasses.fields(cls):
        add_field_flag(p, f)
    given = vars(p.parse_args(argv))
    preset, config_path = given.pop("preset"), given.pop("config")
    base = presets[preset][1] if preset else {}
    if config_path:
        base = read_config_file(cls, config_path)
    flags = {k: v for k, v in given.items() if v is not None}
    for k, v in flags.items():
        if isinstance(v, list):  # a repeated flag's values (add_field_flag)
            flags[k] = ",".join(v)
    return cls(**{**base, **flags})
