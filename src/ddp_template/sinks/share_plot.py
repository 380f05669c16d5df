"""Pictures of the ranks' shares: which dataset index each rank reads, and which slots repeat.

A silent data bug (overlapping shares, padding counted as data, dropped samples) is easiest to
see: each run saves its first epoch's shares as ``shares.png`` (drawn in a background thread)
and ``make shares`` draws the README figure, one panel per sampler mode.
"""

from __future__ import annotations

import argparse
import copy
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np

from ddp_template.data.contract import Sampler
from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.data.samplers import ShareSampler
from ddp_template.sinks.share_draw import Shares, draw_shares, save

__all__ = ["Shares", "draw_shares", "shares_from_sampler", "save_shares_png", "save_modes_png"]

log = logging.getLogger("ddp_template")
PICTURE_MAX_N = 2_000_000  # above this, drawing every rank's share would cost O(N) at start


def shares_from_sampler(sampler: ShareSampler) -> Shares:
    """Every rank's list for the sampler's current epoch, as the sampler defines it."""
    ranks, padding = [], []
    for rank in range(sampler.num_replicas):
        idx = np.asarray(sampler.rank_indices(rank), dtype=np.int64)
        ranks.append(idx)
        padding.append(np.asarray(sampler.is_padding(np.arange(idx.size), rank), dtype=bool))
    return Shares(mode=sampler.mode, num_samples=sampler.base_size, ranks=ranks, padding=padding)


def draw_shares_async(sampler: Sampler, run_dir: Path) -> threading.Thread | None:
    """Draw ``shares.png`` for the current epoch in a background thread (rank 0 only).

    matplotlib costs about a second to import and draw; a thread keeps that off the path to the
    first optimizer step. Returns the thread (join it before logging the image) or None.
    """
    if sampler.dataset_size > PICTURE_MAX_N:
        log.info("shares.png skipped: N=%d > %d", sampler.dataset_size, PICTURE_MAX_N)
        return None
    # a pictured kind's sampler: a ShareSampler; the loop moves on (set_epoch) while this draws
    frozen = copy.copy(cast(ShareSampler, sampler))

    def draw() -> None:
        save_shares_png(run_dir / "shares.png", shares_from_sampler(frozen))

    thread = threading.Thread(target=draw, name="shares-png", daemon=True)
    thread.start()
    return thread


def save_shares_png(path: str | Path, shares: Shares, title: str | None = None) -> Path:
    """A run's `shares.png`."""
    return save(path, [shares], [title])


def save_modes_png(
    path: str | Path, n: int = 11, world: int = 2, shuffle: bool = False, seed: int = 0
) -> Path:
    """The README picture: the same N and W under each mode, one panel per mode."""
    panels, titles = [], []
    for mode, rule in SAMPLER_MODES.items():
        mode_shuffle = shuffle and rule.shuffles
        sampler = ShareSampler(range(n), world, 0, shuffle=mode_shuffle, seed=seed, mode=mode)
        panels.append(shares_from_sampler(sampler))
        titles.append(f"{mode} (shuffle={mode_shuffle}, seed={seed})" if shuffle else mode)
    return save(path, panels, titles)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m ddp_template.sinks.share_plot --out docs/shares.png` (`make shares`)."""
    parser = argparse.ArgumentParser(description="Draw the sampler modes' shares.")
    parser.add_argument("--out", type=Path, default=Path("docs/shares.png"))
    parser.add_argument("--n", type=int, default=11, help="dataset size N")
    parser.add_argument("--world", type=int, default=2, help="number of ranks W")
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = save_modes_png(args.out, args.n, args.world, args.shuffle, args.seed)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
