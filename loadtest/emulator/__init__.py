"""An emulated vLLM worker: vLLM's HTTP surface over the engine model, in scaled real time.

Run it with `python -m loadtest.emulator --port P` or `kvgate emulate --port P` (flags in
`cli.py`; behaviour in docs/emulator.md). This package never imports `gateway`.
"""
