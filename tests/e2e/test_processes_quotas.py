"""`kvgate serve --processes 2`: a tenant's quota is the tenant's, not each process's. The processes
charge each other's limiters through the local broker, so requests over fresh connections (which
the kernel deals to either process) are admitted up to the tenant's rpm in all, not twice it."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from tests.e2e.harness import (
    SECRET,
    chat_burst,
    metrics_urls,
    serving_processes,
    start_emulator,
    tenant,
    write_gateway_config,
)

KEY = "sk-e2e-quota"
RPM = 12


def _admitted(metrics_url: str) -> int:
    """Chat requests one process answered with 200."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(r'kvgate_requests_total\{endpoint="chat",[^}]*status="200"[^}]*\} (\S+)', text)
    return int(float(found.group(1))) if found else 0


def test_a_tenants_rpm_holds_across_the_processes(tmp_path: Path) -> None:
    worker, emulator = start_emulator("--model", "m", "--time-scale", "20")
    try:
        pools = [{"name": "p", "models": ["m"], "workers": [worker]}]
        tenants = [tenant("t", KEY, quotas={"rpm": RPM})]
        config = write_gateway_config(tmp_path / "gw.yaml", pools, tenants)
        env = {"KVGATE_KEY_SECRET": SECRET.decode()}
        with serving_processes("--config", str(config), env=env) as (base_url, proc):
            statuses = chat_burst(base_url, KEY, 3 * RPM)
            per_process = [_admitted(url) for url in sorted(set(metrics_urls(proc)))]
            assert proc.stop() == 0
    finally:
        emulator.stop()
    assert sorted(set(statuses)) == [200, 429], statuses
    assert sum(per_process) == statuses.count(200)
    assert all(n > 0 for n in per_process), per_process  # both processes admitted some
    # The bucket refills at RPM a minute while the requests go out: a request or two more at most,
    # where each process on its own would have admitted RPM.
    assert RPM <= statuses.count(200) <= RPM + 2, statuses
