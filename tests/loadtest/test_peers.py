from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loadtest.peers import launch
from loadtest.peers.launch import PeerMissing, RunningProcess, build_command, wait_http_ready
from tests.support.processes import free_port

INSTALL_SH = Path(launch.__file__).with_name("install.sh")


def _fake_install(root: Path, name: str, program: str) -> None:
    exe = root / name / "bin" / program
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)


def _cmd(name: str, tmp_path: Path, policy: str | None = None) -> launch.PeerCommand:
    return build_command(
        name,
        port=30001,
        metrics_port=29001,
        worker_urls=["http://127.0.0.1:31001", "http://127.0.0.1:31002"],
        model="emu",
        policy=policy,
        workdir=tmp_path,
    )


@pytest.mark.parametrize("name", launch.PEERS)
def test_missing_peer_is_reported_with_the_install_command(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_PEERS_DIR", str(tmp_path))
    assert not launch.is_installed(name)
    with pytest.raises(PeerMissing, match=f"install.sh {name}"):
        _cmd(name, tmp_path)


def test_unknown_peer_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known: sglang-router"):
        _cmd("nginx", tmp_path)


def test_router_commands_bind_loopback_and_stay_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_PEERS_DIR", str(tmp_path))
    _fake_install(tmp_path, "sglang-router", "python")
    _fake_install(tmp_path, "vllm-router", "vllm-router")
    sgl = _cmd("sglang-router", tmp_path)
    assert sgl.argv[1:3] == ("-m", "sglang_router.launch_router")
    a = list(sgl.argv)
    assert a[a.index("--host") + 1] == "127.0.0.1" and a[a.index("--prometheus-host") + 1] == "127.0.0.1"
    assert a[a.index("--policy") + 1] == "cache_aware" and a[a.index("--log-level") + 1] == "warn"
    assert a[a.index("--worker-urls") + 1 : a.index("--worker-urls") + 3] == [
        "http://127.0.0.1:31001",
        "http://127.0.0.1:31002",
    ]
    v = list(_cmd("vllm-router", tmp_path, policy="round_robin").argv)
    assert v[0].endswith("vllm-router/bin/vllm-router")
    assert v[v.index("--policy") + 1] == "round_robin" and v[v.index("--prometheus-port") + 1] == "29001"


@pytest.mark.parametrize("policy", [None, "prefix_hash"])
def test_smg_launches_router_only_on_loopback_without_a_tokenizer_download(
    policy: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_PEERS_DIR", str(tmp_path))
    _fake_install(tmp_path, "smg", "smg")
    a = list(_cmd("smg", tmp_path, policy=policy).argv)
    assert a[0].endswith("smg/bin/smg") and a[1] == "launch"
    assert a[a.index("--host") + 1] == "127.0.0.1" and a[a.index("--prometheus-host") + 1] == "127.0.0.1"
    assert a[a.index("--port") + 1] == "30001" and a[a.index("--prometheus-port") + 1] == "29001"
    assert a[a.index("--policy") + 1] == (policy or "cache_aware")
    assert "--disable-tokenizer-autoload" in a and a[a.index("--log-level") + 1] == "warn"
    urls = a[a.index("--worker-urls") + 1 : a.index("--worker-urls") + 3]
    assert urls == ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]


def test_install_script_knows_smg_in_a_venv_of_its_own(tmp_path: Path) -> None:
    text = INSTALL_SH.read_text()
    assert '[smg]="${SMG_SPEC:-smg==1.13.0}"' in text
    proc = subprocess.run(
        ["bash", str(INSTALL_SH), "nope"],
        env={"KVGATE_PEERS_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "smg" in proc.stderr.split("known:")[1]


def test_litellm_config_lists_every_worker_and_keeps_the_cost_map_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_PEERS_DIR", str(tmp_path))
    _fake_install(tmp_path, "litellm", "litellm")
    cmd = _cmd("litellm", tmp_path)
    assert cmd.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert cmd.config_text is not None and cmd.api_key
    cfg = yaml.safe_load(cmd.config_text)
    bases = [m["litellm_params"]["api_base"] for m in cfg["model_list"]]
    assert bases == ["http://127.0.0.1:31001/v1", "http://127.0.0.1:31002/v1"]
    assert {m["model_name"] for m in cfg["model_list"]} == {"emu"}
    assert cfg["router_settings"]["routing_strategy"] == "simple-shuffle"


def test_install_script_rejects_unknown_peers(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(INSTALL_SH), "nginx"],
        env={"KVGATE_PEERS_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "unknown peer 'nginx'" in proc.stderr
    assert not (tmp_path / "nginx").exists()


@pytest.mark.e2e
def test_running_process_waits_for_readiness_and_stops_by_pid(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(tmp_path)]
    proc = RunningProcess(argv, log_path=tmp_path / "srv.log")
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/", proc, timeout_s=15)
    finally:
        proc.stop()
    assert proc.proc.returncode is not None


@pytest.mark.e2e
def test_a_process_that_dies_fails_readiness_with_its_log(tmp_path: Path) -> None:
    proc = RunningProcess(
        [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log_path=tmp_path / "x.log"
    )
    try:
        with pytest.raises(RuntimeError, match="boom"):
            wait_http_ready(f"http://127.0.0.1:{free_port()}/", proc, timeout_s=15)
    finally:
        proc.stop()


def test_overhead_bench_reports_smg_missing_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loadtest import bench_overhead
    from loadtest.overhead_targets import TargetMissing

    monkeypatch.setenv("KVGATE_PEERS_DIR", str(tmp_path))
    targets = bench_overhead.build_targets(["smg-cache_aware", "smg-prefix_hash"], upstream_clients=False)
    assert [t.name for t in targets] == ["smg cache_aware", "smg prefix_hash"]
    with pytest.raises(TargetMissing, match=r"install\.sh smg"):
        targets[0].start("http://127.0.0.1:1", tmp_path)


def test_overhead_report_adds_a_cpu_ratio_against_smg_only_when_it_ran() -> None:
    from loadtest.overhead_load import LoadResult
    from loadtest.overhead_report import report
    from loadtest.overhead_runner import BenchConfig, TargetResult

    def target(name: str, baseline: str | None, *cpu: float) -> TargetResult:
        runs = [LoadResult(32, 100, 0, 1.0, 100.0, 1.0, 2.0, c) for c in cpu]
        return TargetResult(name, baseline, runs)

    sgl = target("sglang-router cache_aware", None, 100, 100, 100)
    smg = target("smg cache_aware", "sglang-router cache_aware", 150, 200, 300)
    cost = target("kvgate cost", "sglang-router cache_aware", 180, 200, 150)
    cfg = BenchConfig(5, 1, (32,), 0, "builtin", "builtin", False, ())
    text = report([sgl, smg, cost], cfg, "backend")
    assert "| CPU vs smg cache_aware |" in text
    cost_row = next(line for line in text.splitlines() if line.startswith("| kvgate cost |"))
    # Same-round ratios 1.2, 1.0, 0.5: median 1.0.
    assert "| 1.80x sglang-router cache_aware | 1.00x |" in cost_row
    smg.missing = "not installed"
    assert "CPU vs smg" not in report([sgl, smg, cost], cfg, "backend")
