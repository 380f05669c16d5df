"""Drawing the ranks' shares with matplotlib: a labelled cell per slot for small N, else counts and
binned coverage. Takes plain arrays (`Shares`), so it never depends on sampler internals;
imports matplotlib lazily and draws on a bare `Figure` (Agg), so it works headless and leaves
pyplot's global backend alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SMALL_N = 64  # up to this many samples every slot gets its own labelled cell
STRIP_WRAP = 32  # the dataset strip wraps after this many cells (unless a rank row is longer)
COVERAGE_BINS = 100
PAD_HATCH = "////"
DROP_HATCH = "xxx"
CELL_IN = 0.42  # inches per cell in the small-N grid
DPI = 120


@dataclass
class Shares:
    """One epoch's per-rank index lists and padding flags, as plain arrays."""

    mode: str
    num_samples: int  # N
    ranks: list[np.ndarray]  # per-rank index lists (epoch order)
    padding: list[np.ndarray]  # per-rank bool arrays, True where that slot is padding

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def dropped(self) -> np.ndarray:
        """Dataset indices no rank reads at all (drop_last trims them)."""
        seen = np.zeros(self.num_samples, dtype=bool)
        for idx in self.ranks:
            seen[np.asarray(idx)] = True
        return np.flatnonzero(~seen)


# ----------------------------------------------------------------------------- helpers
def _rank_colors(world: int) -> list[tuple[float, ...]]:
    """Distinct qualitative colours for up to 20 ranks, a continuous map beyond."""
    import matplotlib

    if world <= 10:
        return [matplotlib.colormaps["tab10"](r) for r in range(world)]
    if world <= 20:
        return [matplotlib.colormaps["tab20"](r) for r in range(world)]
    return [matplotlib.colormaps["turbo"](r / (world - 1)) for r in range(world)]


def _tint(color: Sequence[float], amount: float) -> tuple[float, float, float]:
    """Blend a colour towards white, so black text stays readable on it."""
    return tuple(c + (1.0 - c) * amount for c in color[:3])  # type: ignore[return-value]


def _dropped_text(dropped: np.ndarray, limit: int = 12) -> str:
    shown = ", ".join(str(i) for i in dropped[:limit].tolist())
    more = f", … ({dropped.size:,} in all)" if dropped.size > limit else ""
    return f"dropped: {shown}{more}"


def _headline(shares: Shares, title: str | None) -> str:
    """Title plus the numbers a reader checks first: slots per rank, padding, dropped."""
    sizes = sorted({idx.size for idx in shares.ranks}, reverse=True) or [0]
    per_rank = " or ".join(f"{size:,}" for size in sizes)  # `exact`: ceil or floor(N/W)
    pads = sum(int(p.sum()) for p in shares.padding)
    stats = (
        f"N={shares.num_samples:,}, W={shares.world_size}: per-rank length {per_rank}, "
        f"{pads:,} padding, {shares.dropped().size:,} dropped"
    )
    return f"{title or shares.mode}  ·  {stats}"


# ----------------------------------------------------------------------------- small N
def _cell(ax: Any, x: float, y: float, label: str, color: Any, hatch: str | None) -> None:
    """One slot: a tinted square (hatched when padding/dropped) with its index written in it."""
    from matplotlib.patches import Rectangle

    face = (0.93, 0.93, 0.93) if color is None else _tint(color, 0.75 if hatch else 0.35)
    edge = (0.45, 0.45, 0.45) if color is None else color
    ax.add_patch(
        Rectangle(
            (x + 0.04, y + 0.04),
            0.92,
            0.92,
            facecolor=face,
            edgecolor=edge,
            hatch=hatch,
            linewidth=1.2,
        )
    )
    style = "italic" if hatch else "normal"
    ax.text(
        x + 0.5,
        y + 0.5,
        label,
        ha="center",
        va="center",
        fontsize=9,
        style=style,
        fontweight="normal" if hatch else "bold",
        bbox={"boxstyle": "round,pad=0.1", "fc": face, "ec": "none"} if hatch else None,
    )


def _grid_shape(shares: Shares) -> tuple[int, int]:
    """Columns of the grid and rows of the dataset strip, which wraps beyond STRIP_WRAP cells."""
    per_rank = max((idx.size for idx in shares.ranks), default=0)
    cols = max(per_rank, min(shares.num_samples, STRIP_WRAP), 1)
    return cols, -(-shares.num_samples // cols)


def _draw_strip(ax: Any, shares: Shares, colors: list, top: float, cols: int) -> None:
    """Every dataset index once, coloured by the rank whose real slot reads it."""
    n = shares.num_samples
    owner = np.full(n, -1)
    for r, (idx, pad) in enumerate(zip(shares.ranks, shares.padding, strict=True)):
        owner[idx[~pad]] = r
    reads = np.bincount(np.concatenate(shares.ranks), minlength=n)
    for i, o in enumerate(owner.tolist()):
        x, y = i % cols, top + i // cols
        _cell(ax, x, y, str(i), colors[o] if o >= 0 else None, DROP_HATCH if o < 0 else None)
        if reads[i] > 1:  # padding repeats it (or, in a buggy deal, two ranks read it)
            ax.text(x + 0.93, y + 0.1, f"×{reads[i]}", ha="right", va="top", fontsize=7)


def _draw_cells(ax: Any, shares: Shares, colors: list) -> None:
    """Row per rank (epoch order), then a strip of the dataset coloured by who reads each index."""
    world = shares.world_size
    cols, strip_rows = _grid_shape(shares)
    for r, (idx, pad) in enumerate(zip(shares.ranks, shares.padding, strict=True)):
        for pos, (i, p) in enumerate(zip(idx.tolist(), pad.tolist(), strict=True)):
            _cell(ax, pos, r, str(i), colors[r], PAD_HATCH if p else None)
    top = world + 0.6
    _draw_strip(ax, shares, colors, top, cols)
    bottom = top + strip_rows
    ax.text(
        0.04,
        bottom + 0.15,
        "rows: each rank's epoch list in order  ·  dataset: every index, "
        "coloured by the rank that reads it (×2: read twice)",
        fontsize=8,
        color="0.35",
        va="top",
    )
    ax.set_xlim(-0.1, cols + 0.1)
    ax.set_ylim(bottom + 0.6, -0.1)
    ax.set_aspect("equal")
    ax.set_yticks(
        [r + 0.5 for r in range(world)] + [top + 0.5],
        [f"rank {r}" for r in range(world)] + ["dataset"],
    )
    ax.set_xticks([])
    ax.tick_params(left=False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    _cell_legend(ax, colors, shares)


def _cell_legend(ax: Any, colors: list, shares: Shares) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=_tint(c, 0.35), edgecolor=c, label=f"rank {r}")
        for r, c in enumerate(colors)
    ]
    handles.append(
        Patch(facecolor="white", edgecolor="0.3", hatch=PAD_HATCH, label="padding (repeat)")
    )
    dropped = shares.dropped()
    if dropped.size:
        handles.append(
            Patch(
                facecolor="0.93", edgecolor="0.45", hatch=DROP_HATCH, label=_dropped_text(dropped)
            )
        )
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
        fontsize=9,
        handleheight=1.4,
    )


# ----------------------------------------------------------------------------- large N
def _draw_counts(ax: Any, shares: Shares, colors: list) -> None:
    """Per rank: real vs padding slots; unequal bars or padding beyond W-1 mean a bug."""
    ranks = np.arange(shares.world_size)
    pads = np.array([int(p.sum()) for p in shares.padding])
    real = np.array([p.size for p in shares.padding]) - pads
    ax.barh(ranks, real, color=colors, label="real")
    ax.barh(
        ranks, pads, left=real, color="white", edgecolor=colors, hatch=PAD_HATCH, label="padding"
    )
    if shares.world_size <= 16:
        ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
        for r in ranks:
            ax.text(
                real[r] * 0.02,
                r,
                f"{real[r]:,} + {pads[r]:,} pad",
                va="center",
                fontsize=8,
                color="white",
                fontweight="bold",
            )
    ax.invert_yaxis()
    ax.set_xlabel("slots in this epoch")
    ax.set_ylabel("rank")
    ax.set_title("real vs padding slots per rank", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)


def _coverage_note(shares: Shares) -> str:
    """The numbers a binned plot hides: unique coverage, the most-read index, what was dropped."""
    n = shares.num_samples
    reads: np.ndarray | list[int] = (
        np.bincount(np.concatenate(shares.ranks), minlength=n) if shares.ranks else []
    )
    note = f"unique coverage {np.count_nonzero(reads) / n:.4%}  ·  max reads of one index "
    note += str(int(np.max(reads, initial=0)))
    dropped = shares.dropped()
    return note + (f"\n{_dropped_text(dropped, limit=5)}" if dropped.size else "")


def coverage_bins(shares: Shares, bins: int = COVERAGE_BINS) -> tuple[np.ndarray, np.ndarray]:
    """Integer bin edges and, stacked over ranks 0..r, reads per index in each bin (bin k holds
    i with i * bins // N == k): counts over the bin's size, so a clean epoch tops at exactly 1.0."""
    n, bins = shares.num_samples, min(bins, shares.num_samples)
    edges = -(-np.arange(bins + 1) * n // bins)  # ceil(k * N / bins): where bin k starts
    reads = [np.bincount(np.asarray(idx) * bins // n, minlength=bins) for idx in shares.ranks]
    return edges, np.cumsum(np.array(reads).reshape(len(reads), bins), axis=0) / np.diff(edges)


def _draw_coverage(ax: Any, shares: Shares, colors: list) -> None:
    """Reads per dataset index, binned and stacked by rank: 1.0 everywhere = each index once."""
    edges, tops = coverage_bins(shares)
    tops = np.column_stack([tops, tops[:, -1]])  # step="post" only uses the last to close
    for r, (low, top) in enumerate(zip([np.zeros(edges.size), *tops[:-1]], tops, strict=True)):
        ax.fill_between(edges, low, top, step="post", color=colors[r], linewidth=0)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="each index once")
    ax.set(xlim=(0, shares.num_samples), ylim=(0, max(1.45, float(tops[-1].max()) * 1.3)))
    ax.text(0.01, 0.97, _coverage_note(shares), transform=ax.transAxes, va="top", fontsize=8)
    ax.set(xlabel="dataset index", ylabel="reads per index")
    ax.set_title(f"coverage ({edges.size - 1} bins, stacked by rank)", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)


def _draw_summary(ax: Any, shares: Shares, colors: list) -> None:
    """Too many slots to draw one by one: two compact plots inside the given axes."""
    ax.axis("off")
    _draw_counts(ax.inset_axes([0.06, 0.0, 0.36, 0.88]), shares, colors)
    _draw_coverage(ax.inset_axes([0.52, 0.0, 0.48, 0.88]), shares, colors)


# ----------------------------------------------------------------------------- public
def _is_small(shares: Shares) -> bool:
    return shares.num_samples <= SMALL_N


def draw_shares(ax: Any, shares: Shares, title: str | None = None) -> None:
    """Draw one epoch's shares on `ax`: every slot for small N, else a summary (fast at N=1e6)."""
    colors = _rank_colors(shares.world_size)
    if _is_small(shares):
        _draw_cells(ax, shares, colors)
    else:
        _draw_summary(ax, shares, colors)
    ax.set_title(_headline(shares, title), loc="left", fontsize=10)


def _figsize(panels: Sequence[Shares]) -> tuple[float, float]:
    """Width from the widest grid (cells stay square and readable), height from the rows."""
    if not all(_is_small(sh) for sh in panels):
        return 12.0, 4.2 * len(panels)
    shapes = [_grid_shape(sh) for sh in panels]
    cols = max(c for c, _ in shapes)
    rows = sum(sh.world_size + strip + 1.2 for sh, (_, strip) in zip(panels, shapes, strict=True))
    return min(max(CELL_IN * cols + 3.2, 8.0), 40.0), CELL_IN * rows + 0.75 * len(panels)


def save(path: str | Path, panels: Sequence[Shares], titles: Sequence[str | None]) -> Path:
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=_figsize(panels), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, shares, title in zip(axes, panels, titles, strict=True):
        draw_shares(ax, shares, title)
    fig.savefig(path, dpi=DPI, bbox_inches="tight", pad_inches=0.15)  # keep outside legends
    return path
