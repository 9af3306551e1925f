"""The HTTP gateway: OpenAI surface, tenants, worker registry, upstream proxy, KV events, telemetry."""
