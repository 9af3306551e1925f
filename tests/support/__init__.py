"""The test suite's shared machinery, written once: waiting for a condition (`wait`), free ports
and real processes on 127.0.0.1 such as the emulated worker and a gateway (`processes`), gateway
configs (`gateway_config`), a gateway run in the test's own event loop (`inprocess`), and the
in-process timing of the request path (`request_path_timing`, and with CORS on: `cors_timing`)."""
