"""``Windowed``: the data kind of token files (``data=tokens``).

Map-style data (every sampler mode, feistel for huge N, exact, elastic resume and replay as
for any ``Planned`` data) whose samples are windows of one file: the epoch's report adds each
rank's tokens to its row (the ``shares/report`` table's ``tokens`` column) and names the
file's tail, the tokens after the last whole window, among its drops.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import cast

from ddp_template.config.schema import Config
from ddp_template.data.contract import MapData, Splits
from ddp_template.engine import EpochStats, Trainer, TrainState
from ddp_template.errors import ConfigError
from ddp_template.kind import Planned
from ddp_template.ledger.records import EpochReport, RankLine
from ddp_template.optional.tokens.windows import Cut

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowLine(RankLine):
    """A rank's row of the report with the tokens its windows hold (``block_size`` each: the
    targets the loss averages over)."""

    tokens: int


class Windowed(Planned):
    """Windows of a token file, planned like map-style data."""

    def __init__(self, name: str, cut: Cut) -> None:
        self.name, self.cut = name, cut

    def accept(self, splits: Splits, *, val_fraction: float, target: str) -> None:
        if val_fraction > 0:
            raise ConfigError(
                f"data.val_fraction={val_fraction} would carve validation windows out of "
                f"{self.name}, overlapping the training windows beside them; write a separate "
                f"file (the writer's --val-fraction) and name it data.test, and drop "
                f"data.val_fraction."
            )
        if len(cast(MapData, splits.train)) == 0:
            raise ConfigError(
                f"data.train={self.name} holds {self.cut.tokens} tokens, fewer than one window "
                f"of data.block_size + 1 = {self.cut.block_size + 1}; use a longer file or a "
                f"smaller data.block_size."
            )

    def check(self, cfg: Config, splits: Splits) -> None:
        super().check(cfg, splits)
        t = cfg.transforms
        if str(t.name) != "none" or t.mean is not None:
            raise ConfigError(
                f"transforms={t.name} augments images, not token windows; use transforms=none "
                f"with data=tokens."
            )

    def tail(self) -> str:
        """The file's tokens in no window, as the report's drops name them."""
        lo, hi = self.cut.covered, self.cut.tokens
        return f"{self.name}[{lo}:{hi}] ({hi - lo} tokens after the last whole window)"

    def verify(
        self, stats: EpochStats, tr: Trainer, state: TrainState, start: int, metrics: dict
    ) -> EpochReport | None:
        report = super().verify(stats, tr, state, start, metrics)
        if report is None:
            return None
        block = self.cut.block_size
        ranks: list[RankLine] = [
            WindowLine(**asdict(r), tokens=r.samples * block) for r in report.ranks
        ]
        drops = [*report.drops, self.tail()] if self.cut.tail else report.drops
        tokens = report.total_samples * block
        log.info(
            "epoch tokens (%s): %d windows x %d = %d target tokens; %s",
            self.name,
            report.total_samples,
            block,
            tokens,
            self.tail() if self.cut.tail else "no tail (the windows end at the file's end)",
        )
        return replace(report, ranks=ranks, drops=drops)
