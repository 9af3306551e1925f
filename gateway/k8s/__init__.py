"""Kubernetes discovery: a pool's workers are the ready pods that match a label selector, followed
through the API server with list + watch.

`config` is the pool's `kubernetes` block and `selector` checks its label selectors; `pods` turns a
Pod object into a routable endpoint (these three are pure). `api` speaks the API server's list and
watch protocol over aiohttp, and `source` keeps the routed set and feeds it to
`gateway.discovery.Discovery`.
"""
