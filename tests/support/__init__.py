"""The test suite's shared machinery, written once: waiting for a condition (`wait`), free ports
and real processes on 127.0.0.1 such as the emulated worker and a gateway (`processes`), gateway
configs (`gateway_config`), and a gateway run in the test's own event loop (`inprocess`)."""
