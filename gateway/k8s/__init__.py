"""Kubernetes discovery: a pool's workers are the ready pods that match a label selector, followed
through the API server with list + watch.

`selector` checks label selectors (pure), `pods` turns a Pod object into a routable endpoint (pure),
`api` speaks the API server's list/watch protocol over aiohttp, and `source` keeps the routed set
and feeds it to `gateway.discovery.Discovery`.
"""
