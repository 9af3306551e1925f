"""Benchmarks without the `kvgate[bench]` extra skip their plots with one message; the emulator's
HF tokenizer without the `tokenizers` package is a clean error naming the extra."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.engine.tokenizer import TokenizerError, load_tokenizer
from loadtest.report import plots
from loadtest.report.sampler import LoadSample


@pytest.fixture
def fresh_plots() -> Iterator[None]:
    # The pyplot lookup is cached per process; each test starts and ends without the cache.
    plots._pyplot.cache_clear()
    yield
    plots._pyplot.cache_clear()


def _draw_all(out: Path) -> list[bool]:
    sample = LoadSample(t_s=0.5, worker=0, running=2, waiting=1)
    return [
        plots.ttft_cdf({"kvgate": [0.1, 0.2, 0.4]}, out / "ttft_cdf.png"),
        plots.hit_ratio_bars({"kvgate": 0.3}, 0.5, 0.4, out / "hit_ratio.png"),
        plots.load_over_time({"kvgate": [sample]}, 1, out / "load.png"),
    ]


@pytest.mark.slow
def test_plots_are_written_with_matplotlib(fresh_plots: None, tmp_path: Path) -> None:
    assert _draw_all(tmp_path) == [True, True, True]
    assert all(p.stat().st_size > 0 for p in tmp_path.glob("*.png"))
    assert len(list(tmp_path.glob("*.png"))) == 3


def test_without_matplotlib_plots_are_skipped_with_one_message(
    fresh_plots: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A None entry in sys.modules makes the import fail as if matplotlib were not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _draw_all(tmp_path) == [False, False, False]
    assert list(tmp_path.iterdir()) == []
    err = capsys.readouterr().err
    assert err == "plots skipped: matplotlib is not installed (pip install 'kvgate[bench]')\n"


def test_hf_tokenizer_without_tokenizers_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerError, match=r"pip install 'kvgate\[tokenizer\]'"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
