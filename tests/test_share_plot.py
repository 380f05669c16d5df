"""Shard pictures: right per-rank lists from the real sampler, valid PNGs, fast at large N."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.data.samplers import ShareSampler
from ddp_template.sinks.share_draw import coverage_bins
from ddp_template.sinks.share_plot import (
    Shares,
    draw_shares,
    main,
    save_modes_png,
    save_shares_png,
    shares_from_sampler,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# docs/ARCHITECTURE.md's sampler table, N=11 and W=2 without shuffling:
# (rank 0, rank 1, padding slots of rank 1)
TABLE_11_2 = {
    "padded": ([0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0], [5]),
    "drop_last": ([0, 2, 4, 6, 8], [1, 3, 5, 7, 9], []),
    "sequential": ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 0], [5]),
}


def _png_size(path: Path) -> tuple[int, int]:
    """Fail unless `path` is a complete, decodable PNG; return its pixel size."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


@pytest.mark.parametrize("mode", list(TABLE_11_2))
def test_shares_from_sampler_matches_the_design_table(mode: str) -> None:
    shares = shares_from_sampler(ShareSampler(range(11), 2, 0, shuffle=False, seed=0, mode=mode))
    rank0, rank1, pad1 = TABLE_11_2[mode]
    assert (shares.mode, shares.num_samples, shares.world_size) == (mode, 11, 2)
    assert [r.tolist() for r in shares.ranks] == [rank0, rank1]
    assert not shares.padding[0].any()
    assert np.flatnonzero(shares.padding[1]).tolist() == pad1
    assert shares.dropped().tolist() == ([10] if mode == "drop_last" else [])


def test_shares_from_sampler_shuffled_and_uneven() -> None:
    shuffled = shares_from_sampler(
        ShareSampler(range(11), 2, 0, shuffle=True, seed=0, mode="padded")
    )
    assert [r.tolist() for r in shuffled.ranks] == [[10, 4, 5, 2, 9, 6], [0, 3, 8, 1, 7, 10]]
    assert shuffled.padding[1].tolist() == [False] * 5 + [True]
    seq = shares_from_sampler(
        ShareSampler(range(10), 4, 0, shuffle=False, seed=0, mode="sequential")
    )
    assert [r.tolist() for r in seq.ranks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]
    assert seq.padding[3].tolist() == [False, True, True]


def test_save_modes_png_writes_the_readme_picture(tmp_path: Path) -> None:
    out = save_modes_png(tmp_path / "docs" / "shares.png")
    assert out == tmp_path / "docs" / "shares.png"
    width, height = _png_size(out)
    assert 600 < width < 3000 and 600 < height < 3000


def test_cli_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--out", str(tmp_path / "modes.png"), "--n", "30", "--world", "4", "--shuffle"])
    assert "modes.png" in capsys.readouterr().out
    _png_size(tmp_path / "modes.png")


def test_save_shares_png_for_a_run(tmp_path: Path) -> None:
    shares = shares_from_sampler(
        ShareSampler(range(50), 3, 0, shuffle=True, seed=1, mode="drop_last")
    )
    _png_size(save_shares_png(tmp_path / "run" / "shares.png", shares, title="run-x"))


def _big_shares(n: int, world: int) -> Shares:
    """A padded shares from plain arrays (no sampler involved)."""
    per_rank = -(-n // world)
    slots = np.arange(per_rank * world)
    order = np.random.default_rng(0).permutation(n)[slots % n]
    return Shares(
        "padded",
        n,
        [order[r::world] for r in range(world)],
        [slots[r::world] >= n for r in range(world)],
    )


def test_large_n_is_summarised_not_drawn_cell_by_cell(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    shares = _big_shares(1_000_000, 3)
    _png_size(save_shares_png(tmp_path / "big.png", shares))
    fig = Figure()
    draw_shares(fig.subplots(), shares)
    assert len(list(fig.findobj())) < 2000  # a summary, not a million cells


@pytest.mark.parametrize(
    ("n", "world", "mode"),
    [(1438, 2, "padded"), (10066, 7, "drop_last"), (1000, 8, "sequential"), (150, 3, "padded")],
)
def test_coverage_of_a_clean_epoch_is_exactly_one_in_every_bin(
    n: int, world: int, mode: str
) -> None:
    """Bins of unequal width (1438 in 100: 14 or 15 indices) must not show fake spikes."""
    shuffle = SAMPLER_MODES[mode].shuffles
    shares = shares_from_sampler(ShareSampler(range(n), world, 0, shuffle, 3, mode=mode))
    edges, stacked = coverage_bins(shares)
    assert edges[0] == 0 and edges[-1] == n and (np.diff(edges) >= 1).all()
    assert edges.dtype.kind == "i" and stacked.shape == (world, min(n, 100))
    assert (stacked[-1] == 1.0).all()
    assert (np.diff(stacked, axis=0) >= 0).all()  # stacked: each rank adds its share


@pytest.mark.parametrize(("mode", "sign"), [("padded", 1), ("drop_last", -1)])
def test_coverage_shows_a_real_repeat_or_gap_in_its_bin_only(mode: str, sign: int) -> None:
    shares = shares_from_sampler(ShareSampler(range(1439), 2, 0, True, 3, mode=mode))
    edges, stacked = coverage_bins(shares)
    odd = shares.ranks[1][-1] if mode == "padded" else shares.dropped()[0]  # the one off index
    k = int(np.searchsorted(edges, odd, side="right")) - 1
    expected = np.ones(100)
    expected[k] += sign / (edges[k + 1] - edges[k])
    assert np.array_equal(stacked[-1], expected)


def test_import_is_light_and_drawing_leaves_pyplot_alone(tmp_path: Path) -> None:
    script = (
        "import sys, numpy as np\n"
        "from ddp_template.sinks.share_plot import Shares, save_shares_png\n"
        "assert 'matplotlib' not in sys.modules, 'imported matplotlib eagerly'\n"
        "sh = Shares('padded', 3, [np.array([0, 2]), np.array([1, 0])],\n"
        "                  [np.array([False, False]), np.array([False, True])])\n"
        f"save_shares_png({str(tmp_path / 'x.png')!r}, sh)\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'switched pyplot backends'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    _png_size(tmp_path / "x.png")
