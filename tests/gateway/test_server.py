from __future__ import annotations

import gc

from gateway.server import GC_THRESHOLDS, base_url, tune_gc


def test_tune_gc_freezes_startup_objects_and_raises_the_thresholds() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0  # what startup built is out of the collector's sight
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_base_url_brackets_ipv6_literals() -> None:
    assert base_url("127.0.0.1", 8080) == "http://127.0.0.1:8080/v1"
    assert base_url("::1", 8080) == "http://[::1]:8080/v1"
