import subprocess
import sys


def test_help_lists_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ("serve", "normalize", "emulate", "simulate", "bench"):
        assert name in out


def test_unknown_command_fails_cleanly() -> None:
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
