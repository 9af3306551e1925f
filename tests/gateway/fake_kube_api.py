"""A fake Kubernetes API server for Pods on 127.0.0.1: the real list and watch JSON protocol.

List (`GET /api/v1/namespaces/NS/pods?labelSelector=..&limit=..&continue=..`) answers a PodList
with `metadata.resourceVersion` (and `continue` while pages remain). Watch (`watch=1`,
`resourceVersion`, `allowWatchBookmarks`, `timeoutSeconds`) streams newline-delimited
`{"type": ..., "object": ...}` events after the given version: an `ERROR` event with a 410 Status
when that version is older than the retained history, as the real server does.

Tests drive it in-process (`FakeKubeApi` methods), or run it as a process
(`python -m tests.gateway.fake_kube_api --port P`) and drive it through `/_fake/...` routes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import re
import ssl
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

Pod = dict[str, Any]


def make_pod(
    name: str,
    ip: str = "127.0.0.1",
    *,
    port: int = 8000,
    port_name: str = "http",
    ready: bool = True,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    phase: str = "Running",
    extra_ports: Mapping[str, int] | None = None,
) -> Pod:
    """A Pod object as the API server returns it (only the fields discovery reads, plus a few)."""
    ports = [{"name": port_name, "containerPort": port, "protocol": "TCP"}]
    ports += [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in (extra_ports or {}).items()]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "uid": f"uid-{name}",
            "labels": dict(labels if labels is not None else {"app": "vllm"}),
            "annotations": dict(annotations or {}),
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai", "ports": ports}]},
        "status": {
            "phase": phase,
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        },
    }


def set_ready(pod: Pod, ready: bool) -> None:
    for cond in pod["status"]["conditions"]:
        if cond["type"] == "Ready":
            cond["status"] = "True" if ready else "False"


_REQ = re.compile(r"^\s*(!?)([^\s!=<>()]+)\s*(?:(==|!=|=)\s*(\S*)|\s(in|notin)\s*\(([^)]*)\))?\s*$")


def matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Equality, inequality, set and existence requirements (what the tests use)."""
    for req in re.split(r",(?![^(]*\))", selector):
        m = _REQ.match(req)
        if m is None:
            raise ValueError(req)
        neg, key, op, value, set_op, values = m.groups()
        have = labels.get(key)
        if op in ("=", "=="):
            ok = have == value
        elif op == "!=":
            ok = have != value
        elif set_op is not None:
            inside = have in {v.strip() for v in values.split(",")}
            ok = inside if set_op == "in" else not inside
        else:
            ok = (have is None) if neg else (have is not None)
        if not ok:
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubeApi:
    """The pods of one namespace, their change history, and the open watch streams."""

    def __init__(self, namespace: str = "llm", token: str | None = None) -> None:
        self.namespace = namespace
        self.token = token
        self.pods: dict[str, Pod] = {}
        self.version = 1000
        self.history: list[tuple[int, str, Pod, Pod | None]] = []
        self.oldest = self.version  # watches from an older version get 410
        self.watchers: set[asyncio.Queue[tuple[str, Any]]] = set()
        self.lists = 0  # list requests (first pages)
        self.watches = 0
        self.unauthorized = 0
        self.bookmark_every_s = 0.5
        self.max_watch_s: float | None = None  # end every watch this soon, whatever it asked for
        self.list_error: tuple[int, str] | None = None  # answer every list with this status
        self.list_garbage: bytes | None = None  # answer every list 200 with this (not the API)
        self.list_versions: list[str | None] = []  # each list's resourceVersion (first pages)
        self.list_limits: list[str | None] = []  # each page request's limit
        self.watch_versions: list[str | None] = []  # each watch's resourceVersion
        # The next watch requests answered with an HTTP error: (status, reason, Retry-After).
        self.watch_errors: list[tuple[int, str, int | str | None]] = []
        self.lists_held = 0  # list requests waiting for `release_lists`
        self._list_gate = asyncio.Event()
        self._list_gate.set()
        self._pages: dict[str, tuple[str, list[Pod]]] = {}
        self._page_ids = itertools.count()
        self.port = 0
        self._runner: web.AppRunner | None = None

    # -- changes ---------------------------------------------------------------------------

    def _bump(self, pod: Pod) -> Pod:
        self.version += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.version)
        return pod

    def _emit(self, kind: str, pod: Pod, old: Pod | None) -> None:
        self.history.append((self.version, kind, pod, old))
        for queue in self.watchers:
            queue.put_nowait(("event", (kind, pod, old)))

    def put(self, pod: Pod) -> None:
        """Create or update a pod (ADDED or MODIFIED)."""
        name = pod["metadata"]["name"]
        old = self.pods.get(name)
        self.pods[name] = self._bump(pod)
        self._emit("ADDED" if old is None else "MODIFIED", self.pods[name], old)

    def delete(self, name: str) -> None:
        pod = self._bump(self.pods.pop(name))
        self._emit("DELETED", pod, None)

    def ready(self, name: str, ready: bool) -> None:
        pod = copy.deepcopy(self.pods[name])
        set_ready(pod, ready)
        self.put(pod)

    def change_silently(self, pods: list[Pod]) -> None:
        """Replace every pod without telling open watches (events a client missed)."""
        self.pods = {p["metadata"]["name"]: self._bump(p) for p in pods}

    def expire(self) -> None:
        """Forget the history (a compaction): open watches get an ERROR 410 event and end."""
        self.oldest = self.version
        self.history.clear()
        self.send_error(410, "Expired", "too old resource version")

    def send_error(self, code: int, reason: str, message: str) -> None:
        for queue in self.watchers:
            queue.put_nowait(("error", _status(code, reason, message)))

    def send_raw(self, data: bytes) -> None:
        for queue in self.watchers:
            queue.put_nowait(("raw", data))

    def end_watches(self) -> None:
        """End open watch streams cleanly, as the server does after timeoutSeconds."""
        for queue in self.watchers:
            queue.put_nowait(("end", None))

    def stall_watches(self) -> None:
        """Open watches go silent, bookmarks too, and stay open (a link whose far end is gone)."""
        for queue in self.watchers:
            queue.put_nowait(("stall", None))

    def drop_watches(self) -> None:
        """Cut open watch connections mid-stream."""
        for queue in self.watchers:
            queue.put_nowait(("drop", None))

    def fail_watches(
        self, count: int, code: int, reason: str, retry_after_s: int | str | None = None
    ) -> None:
        """Answer the next `count` watch requests with an HTTP `code` (and Retry-After)."""
        self.watch_errors += [(code, reason, retry_after_s)] * count

    def hold_lists(self) -> None:
        """Lists wait, unanswered, until `release_lists` (an API server under load)."""
        self._list_gate.clear()

    def release_lists(self) -> None:
        self._list_gate.set()

    # -- HTTP ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods_route)
        app.router.add_post("/_fake/pods", self._ctl_put)
        app.router.add_delete("/_fake/pods/{name}", self._ctl_delete)
        app.router.add_post("/_fake/pods/{name}/ready", self._ctl_ready)
        app.router.add_post("/_fake/expire", self._ctl_expire)
        app.router.add_get("/_fake/stats", self._ctl_stats)
        return app

    async def start(self, port: int = 0, ssl_context: ssl.SSLContext | None = None) -> int:
        self._runner = web.AppRunner(self.app(), shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def stop(self) -> None:
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pods_route(self, request: web.Request) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return _json(_status(401, "Unauthorized", "Unauthorized"), 401)
        if request.match_info["namespace"] != self.namespace:
            return _json({"kind": "PodList", "metadata": {"resourceVersion": str(self.version)}, "items": []})
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") in ("1", "true"):
            return await self._watch(request, selector)
        return await self._list(request, selector)

    def _selected(self, selector: str, pods: list[Pod]) -> list[Pod]:
        return [p for p in pods if not selector or matches(selector, p["metadata"].get("labels", {}))]

    def _seen_as(self, selector: str, kind: str, pod: Pod, old: Pod | None) -> str | None:
        """What a filtered watch reports: a pod that starts matching is ADDED, one that stops
        matching is DELETED, as the real server's watch cache does."""
        now, before = bool(self._selected(selector, [pod])), bool(old and self._selected(selector, [old]))
        if kind != "MODIFIED":
            return kind if now else None
        if now:
            return "MODIFIED" if before else "ADDED"
        return "DELETED" if before else None

    async def _list(self, request: web.Request, selector: str) -> web.Response:
        if not self._list_gate.is_set():
            self.lists_held += 1
            try:
                await self._list_gate.wait()
            finally:
                self.lists_held -= 1
        if self.list_garbage is not None:
            self.lists += 1
            return web.Response(body=self.list_garbage, content_type="text/html")
        if self.list_error is not None:
            self.lists += 1
            self.list_versions.append(request.query.get("resourceVersion"))
            code, reason = self.list_error
            return _json(_status(code, reason, f"pods is {reason.lower()}"), code)
        self.list_limits.append(request.query.get("limit"))
        limit = int(request.query.get("limit", "0") or 0)
        token = request.query.get("continue")
        if token:  # kept: a client may ask for the same page again, with another limit
            version, items = self._pages[token]
        else:
            self.lists += 1
            self.list_versions.append(request.query.get("resourceVersion"))
            version = str(self.version)
            items = self._selected(selector, sorted(self.pods.values(), key=lambda p: p["metadata"]["name"]))
        meta: dict[str, Any] = {"resourceVersion": version}
        if limit and len(items) > limit:
            next_token = f"page-{next(self._page_ids)}"
            self._pages[next_token] = (version, items[limit:])
            meta["continue"] = next_token
            items = items[:limit]
        return _json({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items})

    async def _watch(self, request: web.Request, selector: str) -> web.StreamResponse:
        self.watches += 1
        self.watch_versions.append(request.query.get("resourceVersion"))
        if self.watch_errors:
            code, reason, retry_after_s = self.watch_errors.pop(0)
            response = _json(_status(code, reason, reason), code)
            if retry_after_s is not None:
                response.headers["Retry-After"] = str(retry_after_s)
            return response
        since = int(request.query.get("resourceVersion") or self.version)
        timeout_s = float(request.query.get("timeoutSeconds", "300"))
        if self.max_watch_s is not None:
            timeout_s = min(timeout_s, self.max_watch_s)
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)

        async def send(kind: str, obj: Mapping[str, Any]) -> None:
            await resp.write(orjson.dumps({"type": kind, "object": obj}) + b"\n")

        if since < self.oldest:
            await send("ERROR", _status(410, "Expired", f"too old resource version: {since}"))
            return resp
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        for version, kind, pod, old in self.history:
            if version > since:
                queue.put_nowait(("event", (kind, pod, old)))
        self.watchers.add(queue)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                try:
                    what, data = await asyncio.wait_for(queue.get(), min(left, self.bookmark_every_s))
                except TimeoutError:
                    if bookmarks:
                        meta = {"resourceVersion": str(self.version)}
                        await send("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": meta})
                    continue
                if what == "event":
                    seen = self._seen_as(selector, *data)
                    if seen is not None:
                        await send(seen, data[1])
                elif what == "error":
                    await send("ERROR", data)
                    break
                elif what == "raw":
                    await resp.write(data)
                elif what == "end":
                    break
                elif what == "stall":
                    await asyncio.sleep(left)
                    break
                elif what == "drop":
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
        finally:
            self.watchers.discard(queue)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    async def _ctl_put(self, request: web.Request) -> web.Response:
        self.put(await request.json())
        return _json({"ok": True})

    async def _ctl_delete(self, request: web.Request) -> web.Response:
        self.delete(request.match_info["name"])
        return _json({"ok": True})

    async def _ctl_ready(self, request: web.Request) -> web.Response:
        self.ready(request.match_info["name"], bool((await request.json())["ready"]))
        return _json({"ok": True})

    async def _ctl_expire(self, request: web.Request) -> web.Response:
        self.expire()
        return _json({"ok": True})

    async def _ctl_stats(self, request: web.Request) -> web.Response:
        return _json({"lists": self.lists, "watches": self.watches, "open_watches": len(self.watchers)})


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--namespace", default="llm")
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    fake = FakeKubeApi(args.namespace, args.token)
    web.run_app(fake.app(), host="127.0.0.1", port=args.port, print=None, shutdown_timeout=0.5)


if __name__ == "__main__":
    main()
