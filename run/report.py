"""Live metrics: each step's record, the same as in metrics.jsonl, sent to TensorBoard and/or W&B.

    kinds = parse_report_to(cfg.report_to)  # "none" | "tensorboard" | "wandb" | "tensorboard,wandb"
    check_available(kinds)                  # every rank, before any weights are read
    reporter = Reporter(kinds, cfg.out, run_name, config, first_step=start + 1)  # rank 0 only
    reporter.log(record, step)              # every numeric field but "step"; None values skipped
    reporter.close()

TensorBoard: event files in OUT/tensorboard (`tensorboard --logdir OUT/tensorboard`). A resumed
run appends to them; steps at or after the first step of this launch that an earlier launch wrote
are hidden (SummaryWriter's purge_step), so a restart does not draw two curves.

W&B: one run per launch, its files in OUT/wandb. The mode is WANDB_MODE when set; otherwise
online if credentials are configured (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc), else
offline, which needs no account: `wandb sync OUT/wandb/offline-run-*` uploads it later. The
project is WANDB_PROJECT, else "qwen3-1m".

Both packages are optional and imported only when asked for; a missing one is a ReportError
(a ValueError) that names the pip command.
"""

from __future__ import annotations

import importlib
import json
import math
import netrc
import os
from typing import Any
from urllib.parse import urlsplit

KINDS = ("tensorboard", "wandb")
PIP = {"tensorboard": "tensorboard", "wandb": "wandb"}  # kind -> what to pip install


class ReportError(ValueError):
    """--report-to asks for something that cannot run here; the message says what to do."""


def parse_report_to(values: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Kinds from --report-to, given once comma-separated or repeated; "none" (or nothing) -> []."""
    if values is None:
        return []
    items = [values] if isinstance(values, str) else list(values)
    kinds: list[str] = []
    for item in items:
        for k in (s.strip().lower() for s in item.split(",")):
            if not k or k == "none":
                continue
            if k not in KINDS:
                raise ReportError(
                    f"--report-to {k!r}: use none, {', '.join(KINDS)} or a comma-separated list"
                )
            if k not in kinds:
                kinds.append(k)
    return kinds


def check_available(kinds: list[str]) -> None:
    """Import each asked-for package now, so a missing one fails the run before anything heavy."""
    for k in kinds:
        _import(k)


def _import(kind: str):
    try:
        if kind == "tensorboard":
            importlib.import_module("tensorboard")  # first, so that its absence is what fails
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter
        import wandb

        return wandb
    except ImportError as e:
        raise ReportError(
            f"--report-to {kind} needs the {PIP[kind]} package ({e}); "
            f"install it with: python3 -m pip install {PIP[kind]}"
        ) from e


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields but the step; None, booleans and non-finite values left out."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step"
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


def wandb_mode() -> str:
    """WANDB_MODE if set; else "online" with credentials configured, "offline" without."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    try:  # where `wandb login` stores the key
        found = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    return "online" if found else "offline"


# ---------------------------------------------------------------------------------------------
# The reporter
# ---------------------------------------------------------------------------------------------
class Reporter:
    """Sends step records to the asked-for backends; with no kinds it does nothing."""

    def __init__(
        self,
        kinds: list[str],
        out_dir: str,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        first_step: int = 1,
    ):
        self.kinds, self.dirs = list(kinds), {}
        self._tb = self._wandb = None
        config = config or {}
        if "tensorboard" in self.kinds:
            SummaryWriter = _import("tensorboard")
            self.dirs["tensorboard"] = os.path.join(out_dir, "tensorboard")
            # purge_step: events this launch rewrites (a resume) are dropped from the view.
            self._tb = SummaryWriter(self.dirs["tensorboard"], purge_step=first_step)
            text = json.dumps(config, indent=2, default=str)
            self._tb.add_text(
                "config", "    " + text.replace("\n", "\n    "), global_step=first_step
            )
        if "wandb" in self.kinds:
            wandb = _import("wandb")
            self.dirs["wandb"] = os.path.join(out_dir, "wandb")
            os.makedirs(self.dirs["wandb"], exist_ok=True)
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "qwen3-1m"),
                name=run_name,
                config=config,
                dir=out_dir,
                mode=wandb_mode(),
            )

    def log(self, record: dict[str, Any], step: int) -> None:
        values = scalars(record)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()  # a step takes minutes: let TensorBoard see it now
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
