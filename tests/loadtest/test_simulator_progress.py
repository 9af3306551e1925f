from __future__ import annotations

import io

from loadtest.report.progress import ProgressBar


def test_progress_bar_draws_fraction_and_ends_the_line() -> None:
    out = io.StringIO()
    bar = ProgressBar(4, "run", stream=out, width=8, min_interval_s=0.0)
    bar.update(2)
    bar.close()
    text = out.getvalue()
    assert "run [####....] 2/4" in text and text.endswith("\n")
