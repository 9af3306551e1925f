"""`kvgate bench abuse`: the reliability suite.

It starts a real gateway (`kvgate serve --config`) with two tenants in front of emulated workers
(`python -m loadtest.emulator`) and a small faulty worker, all on free loopback ports, runs every
hostile-client and failing-worker probe against it with a time limit and a bounded number of
requests, optionally soaks it at a share of its measured capacity, and stops every process by PID.
Each probe states what it expects and what it observed; the command exits non-zero when one fails.

| module | job |
|---|---|
| `settings.py` | the full and `--quick` sizes |
| `stack.py` | the processes: gateway config, emulated and faulty workers, start, signals, stop |
| `faulty_worker.py` | a worker that answers garbage, or nothing, while passing health checks |
| `observe.py` | what the suite reads from the stack: RSS, metrics, access log, admin status |
| `client.py` | the HTTP client side: whole answers and streams read to `[DONE]` |
| `probe.py` | what a probe is; running one under its time limit |
| `probes_clients.py` | hostile clients: header floods, slowloris, partial bodies, odd requests |
| `probes_connections.py` | hostile connections: pipelined bursts, one address past its limit |
| `probes_outcomes.py` | outcomes recorded as they happened: complete streams, tpm, bad workers |
| `probes_fleet.py` | workers killed, stopped and restarted under load; index and tenant bounds |
| `probe_drain.py` | SIGTERM drain, the last probe (it stops the gateway) |
| `soak.py` | capacity, then a bounded soak at a share of it |
| `report.py` | the probe record and the table |
| `cli.py` | the command |
"""
