"""Every log line the gateway writes to stderr is one JSON object, whoever logged it: kvgate's
loggers, the OpenTelemetry SDK's exporter, asyncio, uvicorn, Python's warnings; each once, and
at the levels `log_level` / `--log-level` set."""

from __future__ import annotations

import contextlib
import logging
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.config import parse_config
from gateway.logs import setup_logging
from gateway.server import _uvicorn_config
from tests.gateway.logging_state import logging_restored
from tests.support.gateway_config import tenant, write_gateway_config
from tests.support.processes import free_port, start_gateway
from tests.support.wait import wait_until_sync

CONFIG = {
    "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:1"]}],
    "tenants": [tenant("t", "sk-t")],
}
OTLP_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def _lines(text: str) -> list[dict[str, Any]]:
    """Each line of `text` parsed (a line that is no JSON object fails the test, named)."""
    records = []
    for line in text.splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line[:200]!r}") from None
        assert isinstance(record, dict), line
        records.append(record)
    return records


def _log_at_every_level() -> None:
    for name in ("kvgate.test", OTLP_LOGGER, "asyncio"):
        logger = logging.getLogger(name)
        for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
            logger.log(level, "%s at %s", name, logging.getLevelName(level).lower(), extra={"n": level})


@pytest.mark.parametrize(
    ("level", "kvgate_from", "others_from"),
    [("info", logging.INFO, logging.WARNING), ("debug", logging.DEBUG, logging.WARNING), ("error", 40, 40)],
)
def test_every_loggers_lines_are_json_once_at_the_levels_set(
    level: str, kvgate_from: int, others_from: int, capsys: pytest.CaptureFixture[str]
) -> None:
    with logging_restored():
        setup_logging(level)
        _log_at_every_level()
        records = _lines(capsys.readouterr().err)
    seen = [(r["logger"], r["n"]) for r in records]
    levels = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)
    expected = [("kvgate.test", n) for n in levels if n >= kvgate_from]
    expected += [(name, n) for name in (OTLP_LOGGER, "asyncio") for n in levels if n >= others_from]
    assert seen == expected  # each once: the kvgate lines do not reach the root's handler twice
    for r in records:
        assert r["msg"] == f"{r['logger']} at {r['level']}" and isinstance(r["ts"], float)
        assert set(r) == {"ts", "level", "logger", "msg", "n"}


def test_a_python_warning_is_a_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    with logging_restored(), warnings.catch_warnings():
        warnings.simplefilter("always")
        setup_logging("info")
        warnings.warn("an old way", UserWarning, stacklevel=1)
        (record,) = _lines(capsys.readouterr().err)
    assert record["logger"] == "py.warnings" and "UserWarning: an old way" in record["msg"]


@contextlib.contextmanager
def uvicorn_loggers_as_a_process_starts() -> Iterator[None]:
    """uvicorn's loggers as a new process has them (no handler, no level, propagating), and as
    they were after."""
    with logging_restored("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.setLevel(logging.NOTSET)
            logger.propagate = True
        yield


def test_uvicorn_without_its_own_log_config_logs_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    # uvicorn's default log config gives its loggers plain-text handlers; the gateway runs it
    # without one, so its records reach the root's handler.
    with uvicorn_loggers_as_a_process_starts():
        setup_logging("info")
        _uvicorn_config(lambda: None, parse_config(CONFIG))  # type: ignore[arg-type]
        logging.getLogger("uvicorn.error").info("not shown")
        logging.getLogger("uvicorn.error").error("Exception in ASGI application")
        records = _lines(capsys.readouterr().err)
    assert [(r["logger"], r["level"], r["msg"]) for r in records] == [
        ("uvicorn.error", "error", "Exception in ASGI application")
    ]


def test_uvicorns_warnings_keep_to_a_log_level_above_warning(capsys: pytest.CaptureFixture[str]) -> None:
    with uvicorn_loggers_as_a_process_starts():
        setup_logging("error")
        _uvicorn_config(lambda: None, parse_config(CONFIG))  # type: ignore[arg-type]
        logging.getLogger("uvicorn.error").warning("not shown at --log-level error")
        logging.getLogger("uvicorn.error").error("shown")
        records = _lines(capsys.readouterr().err)
    assert [r["msg"] for r in records] == ["shown"]


def test_a_gateway_process_writes_the_otlp_exporters_failures_as_json_lines(
    emulator: str, tmp_path: Path
) -> None:
    config = write_gateway_config(
        tmp_path / "gw.yaml",
        [{"name": "p", "models": ["m"], "workers": [emulator]}],
        [tenant("t", "sk-t")],
        tracing={"enabled": True},
    )
    collector = free_port()  # nothing listens: every export fails
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{collector}/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    port = free_port()
    proc = start_gateway(config, port, env=env)
    try:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"authorization": "Bearer sk-t", "content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200
        wait_until_sync(lambda: "Failed to export spans" in proc.output(), 30, "the exporter's failure")
    finally:
        proc.stop()
    # The one stdout line (the combined output's) is the start-up banner; all the rest is stderr.
    stderr = [x for x in proc.output().splitlines() if not x.startswith("kvgate serve: listening")]
    records = _lines("\n".join(stderr))
    failures = [r for r in records if "Failed to export spans" in r["msg"]]
    assert failures and all(r["logger"].startswith("opentelemetry.") for r in failures), failures
    assert any(r["logger"] == "kvgate.access" for r in records)  # its own lines unchanged
