"""The HTTP face of the emulator: discovery, CRUD, patch and watch, as kopf and kubectl call them.

`Emulator` runs an aiohttp server on its own thread and event loop and offers the tests a
synchronous facade (create/get/patch/delete/wait_for) that bypasses HTTP, so the request
log holds the operator's requests only — what the RBAC test checks against the chart.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import concurrent.futures
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web

from .patching import MERGE_PATCH
from .store import ApiError, Obj, Resource, Store

T = TypeVar("T")
_NAMESPACE_SUBRESOURCES = ("status", "finalize")


@dataclasses.dataclass
class RequestRecord:
    """One API request as RBAC sees it: verb on group/resource[/subresource] in a namespace.

    Logged when the request arrives (a watch may never end); `code` is filled in when it does.
    """

    verb: str
    group: str | None  # None for non-resource URLs (/api, /apis, /version)
    version: str | None
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    path: str
    user_agent: str
    code: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed request path."""

    group: str
    version: str
    plural: str | None
    namespace: str | None
    name: str | None
    subresource: str | None


def parse_path(path: str) -> Target | None:
    """``/apis/batch/v1/namespaces/ns/jobs/x/status`` into its parts; None for non-resource URLs."""
    segs = [s for s in path.split("/") if s]
    if len(segs) >= 2 and segs[0] == "api":
        group, version, rest = "", segs[1], segs[2:]
    elif len(segs) >= 3 and segs[0] == "apis":
        group, version, rest = segs[1], segs[2], segs[3:]
    else:
        return None
    if not rest:
        return Target(group, version, None, None, None, None)
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in _NAMESPACE_SUBRESOURCES:
        namespace, rest = rest[1], rest[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    sub = "/".join(rest[2:]) or None
    return Target(group, version, plural, namespace, name, sub)


def verb_of(method: str, target: Target | None, query: Any) -> str:
    """The RBAC verb of a request."""
    if target is None or target.plural is None:
        return method.lower()
    watching = str(query.get("watch", "")).lower() in ("1", "true")
    if method == "GET":
        if watching:
            return "watch"
        return "get" if target.name else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if target.name else "deletecollection"}.get(method, method.lower())


class Emulator:
    """A Kubernetes API server in a thread, for tests. Use as a context manager."""

    def __init__(self, *, crds: Sequence[str | Path | dict[str, Any]] = (), bookmark_interval: float = 10.0,
                 max_watch_seconds: float = 1800.0):
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        self._crds = list(crds)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._requests: list[RequestRecord] = []
        self._stopping: asyncio.Event | None = None
        self.store: Store | None = None
        self.url = ""

    # --- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Emulator:
        ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="k8s-emulator", daemon=True)
        self._thread.start()
        self.url = ready.result(timeout=30)
        for crd in self._crds:
            self.apply(crd)
        return self

    def _run(self, ready: concurrent.futures.Future[str]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(ready))
        except BaseException as e:  # noqa: BLE001 - surface startup failures to start()
            if not ready.done():
                ready.set_exception(e)
        finally:
            loop.close()

    async def _serve(self, ready: concurrent.futures.Future[str]) -> None:
        self.store = Store()
        self._stopping = asyncio.Event()
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set_result(f"http://127.0.0.1:{port}")
        await self._stopping.wait()
        for w in list(self.store.watchers):
            w.queue.put_nowait(None)
        await self._runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=10)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the emulator's loop (where the store lives) and return its result."""
        assert self._loop is not None

        async def run() -> T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Schedule a coroutine on the emulator's loop (for in-process controllers)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # --- the test-facing facade (no HTTP, not logged) --------------------------------------

    def resource(self, api_version: str, plural: str) -> Resource:
        group, _, version = api_version.rpartition("/")
        assert self.store is not None
        return self.call(self.store.resource, group, version, plural)

    def apply(self, doc: str | Path | dict[str, Any]) -> list[Obj]:
        """Create every object of a YAML file (or one dict), as ``kubectl create -f``."""
        docs = [doc] if isinstance(doc, dict) else [d for d in yaml.safe_load_all(Path(doc).read_text()) if d]
        out = []
        for d in docs:
            res = self.call(self.store.resource_for, d["apiVersion"], d["kind"])  # type: ignore[union-attr]
            out.append(self.call(self.store.create, res, (d.get("metadata") or {}).get("namespace"), d))  # type: ignore[union-attr]
        return out

    def create(self, api_version: str, plural: str, body: Obj, namespace: str | None = None) -> Obj:
        res = self.resource(api_version, plural)
        return self.call(self.store.create, res, namespace, body)  # type: ignore[union-attr]

    def get(self, api_version: str, plural: str, name: str, namespace: str | None = None) -> Obj | None:
        res = self.resource(api_version, plural)
        try:
            return self.call(self.store.get, res, namespace, name)  # type: ignore[union-attr]
        except ApiError as e:
            if e.code == 404:
                return None
            raise

    def list(self, api_version: str, plural: str, namespace: str | None = None,
             label_selector: str | None = None) -> list[Obj]:
        res = self.resource(api_version, plural)
        return self.call(self.store.list, res, namespace, label_selector)[0]  # type: ignore[union-attr]

    def patch(self, api_version: str, plural: str, name: str, patch: Any, namespace: str | None = None,
              subresource: str | None = None, content_type: str = MERGE_PATCH) -> Obj:
        res = self.resource(api_version, plural)
        return self.call(self.store.patch, res, namespace, name, content_type, patch,  # type: ignore[union-attr]
                         subresource)

    def delete(self, api_version: str, plural: str, name: str, namespace: str | None = None) -> Obj:
        res = self.resource(api_version, plural)
        return self.call(self.store.delete, res, namespace, name)  # type: ignore[union-attr]

    def events_for(self, name: str, namespace: str = "default") -> builtins.list[Obj]:
        """Core v1 Events whose involvedObject is `name`, oldest first."""
        events = [e for e in self.list("v1", "events", namespace)
                  if (e.get("involvedObject") or {}).get("name") == name]
        return sorted(events, key=lambda e: int(e["metadata"]["resourceVersion"]))

    def printer_columns(self, api_version: str, plural: str, name: str, namespace: str | None = None,
                        *, wide: bool = False) -> dict[str, Any]:
        """What ``kubectl get`` shows for the object: the CRD's additionalPrinterColumns evaluated."""
        res = self.resource(api_version, plural)
        obj = self.get(api_version, plural, name, namespace)
        if obj is None:
            raise KeyError(name)
        out: dict[str, Any] = {"Name": obj["metadata"]["name"]}
        for col in res.printer_columns:
            if col.get("priority", 0) and not wide:
                continue
            value: Any = obj
            for part in col["jsonPath"].lstrip(".").split("."):
                value = value.get(part) if isinstance(value, dict) else None
            out[col["name"]] = value
        return out

    @property
    def requests(self) -> builtins.list[RequestRecord]:
        """Every HTTP request served so far (the operator's, since tests use the facade)."""
        return list(self._requests)

    def wait_for(self, predicate: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.05,
                 message: str = "condition") -> T:
        """Poll `predicate` from the test thread until it returns something truthy."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout}s waiting for {message}; last value: {last!r}")

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        """A kubeconfig pointing at this emulator (plain HTTP, a dummy token)."""
        p = Path(path)
        p.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "operator", "user": {"token": "emulator-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "operator",
                                                          "namespace": namespace}}],
        }))
        return p

    # --- HTTP ------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        target = parse_path(request.path)
        is_resource = target is not None and target.plural is not None
        record = RequestRecord(
            verb=verb_of(request.method, target, request.query),
            group=target.group if target and is_resource else None,
            version=target.version if target and is_resource else None,
            resource=target.plural if target and is_resource else None,
            subresource=target.subresource if target and is_resource else None,
            namespace=target.namespace if target and is_resource else None,
            name=target.name if target and is_resource else None,
            path=request.path, user_agent=request.headers.get("User-Agent", ""),
        )
        self._requests.append(record)
        try:
            response = await handler(request)
            record.code = response.status
            return response
        except ApiError as e:
            record.code = e.code
            return web.json_response(e.status(), status=e.code)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        assert self.store is not None
        path = request.path.rstrip("/") or "/"
        if path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        if path == "/version":
            return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-emulator",
                                      "platform": "linux/amd64"})
        if path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"],
                                      "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                                                      "serverAddress": "127.0.0.1"}]})
        if path == "/apis":
            return web.json_response(self._group_list())
        if path.startswith("/apis/") and path.count("/") == 2:
            group = path.split("/")[2]
            for g in self._group_list()["groups"]:
                if g["name"] == group:
                    return web.json_response({"apiVersion": "v1", "kind": "APIGroup", **g})
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        target = parse_path(path)
        if target is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if target.plural is None:
            return web.json_response(self._resource_list(target.group, target.version))
        if request.method != "GET" or target.name is not None:
            if request.method not in ("GET", "POST", "PUT", "PATCH", "DELETE"):
                raise ApiError(405, "MethodNotAllowed", f"{request.method} is not supported")
        res = self.store.resource(target.group, target.version, target.plural)
        if res.namespaced is False and target.namespace is not None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        verb = verb_of(request.method, target, request.query)
        q = request.query
        if verb == "watch":
            return await self._watch(request, res, target)
        if verb == "list":
            return web.json_response(self._list(res, target, q))
        if verb == "get":
            if target.subresource not in (None, "status"):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return web.json_response(self.store.get(res, target.namespace, target.name or ""))
        body = await self._body(request)
        if verb == "create":
            if target.name is not None:
                raise ApiError(405, "MethodNotAllowed", "POST to a named object is not supported")
            return web.json_response(self.store.create(res, target.namespace, body), status=201)
        if verb == "update":
            return web.json_response(self.store.replace(res, target.namespace, target.name or "", body,
                                                        target.subresource))
        if verb == "patch":
            ctype = request.headers.get("Content-Type", "")
            return web.json_response(self.store.patch(res, target.namespace, target.name or "", ctype, body,
                                                      target.subresource))
        if verb == "delete":
            return web.json_response(self.store.delete(res, target.namespace, target.name or ""))
        if verb == "deletecollection":
            items, _ = self.store.list(res, target.namespace, q.get("labelSelector"), q.get("fieldSelector"))
            for item in items:
                self.store.delete(res, item["metadata"].get("namespace"), item["metadata"]["name"])
            return web.json_response({"apiVersion": res.api_version, "kind": f"{res.kind}List",
                                      "metadata": {}, "items": items})
        raise ApiError(405, "MethodNotAllowed", f"{request.method} is not supported")

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            try:
                return yaml.safe_load(raw)
            except yaml.YAMLError:
                raise ApiError(400, "BadRequest", "the request body is not valid JSON") from None

    def _list(self, res: Resource, target: Target, q: Any) -> Obj:
        assert self.store is not None
        items, rv = self.store.list(res, target.namespace, q.get("labelSelector"), q.get("fieldSelector"))
        meta: dict[str, Any] = {"resourceVersion": rv}
        limit = int(q.get("limit") or 0)
        if q.get("continue"):
            offset, rv = json.loads(base64.b64decode(q["continue"]))
            meta["resourceVersion"] = rv
            items = items[offset:]
        else:
            offset = 0
        if limit and len(items) > limit:
            meta["continue"] = base64.b64encode(json.dumps([offset + limit, rv]).encode()).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return {"apiVersion": res.api_version, "kind": f"{res.kind}List", "metadata": meta, "items": items}

    async def _watch(self, request: web.Request, res: Resource, target: Target) -> web.StreamResponse:
        assert self.store is not None and self._stopping is not None
        q = request.query
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            watcher = self.store.watch(res, target.namespace, q.get("resourceVersion"), q.get("labelSelector"),
                                       q.get("fieldSelector"))
        except ApiError as e:
            # Watch errors arrive inside the stream, as the real server sends 410 Gone.
            await response.write(json.dumps({"type": "ERROR", "object": e.status()}).encode() + b"\n")
            return response
        timeout = min(float(q.get("timeoutSeconds") or self.max_watch_seconds), self.max_watch_seconds)
        deadline = time.monotonic() + timeout
        bookmarks = str(q.get("allowWatchBookmarks", "")).lower() in ("1", "true")
        last_sent = time.monotonic()
        try:
            while not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait = min(left, self.bookmark_interval) if bookmarks else left
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), timeout=wait)
                except asyncio.TimeoutError:
                    event = None
                    if bookmarks and time.monotonic() - last_sent >= self.bookmark_interval * 0.9:
                        await response.write(json.dumps(self._bookmark(res)).encode() + b"\n")
                        last_sent = time.monotonic()
                    continue
                if event is None:
                    break
                await response.write(json.dumps(event).encode() + b"\n")
                last_sent = time.monotonic()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.unwatch(watcher)
        return response

    def _bookmark(self, res: Resource) -> Obj:
        assert self.store is not None
        return {"type": "BOOKMARK", "object": {"apiVersion": res.api_version, "kind": res.kind,
                                               "metadata": {"resourceVersion": str(self.store.rv)}}}

    def _group_list(self) -> Obj:
        assert self.store is not None
        groups: dict[str, list[str]] = {}
        for res in self.store.resources.values():
            if res.group:
                versions = groups.setdefault(res.group, [])
                if res.version not in versions:
                    versions.append(res.version)
        return {"apiVersion": "v1", "kind": "APIGroupList", "groups": [
            {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
             "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}}
            for g, vs in sorted(groups.items())
        ]}

    def _resource_list(self, group: str, version: str) -> Obj:
        assert self.store is not None
        found = [r for r in self.store.resources.values() if r.group == group and r.version == version]
        if not found:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        items = []
        for r in found:
            items.append({"name": r.plural, "singularName": r.singular, "namespaced": r.namespaced,
                          "kind": r.kind, "verbs": list(r.verbs), "shortNames": list(r.short_names),
                          "categories": list(r.categories)})
            for sub in r.subresources:
                items.append({"name": f"{r.plural}/{sub}", "singularName": "", "namespaced": r.namespaced,
                              "kind": r.kind, "verbs": ["get", "patch", "update"]})
        return {"apiVersion": "v1", "kind": "APIResourceList", "groupVersion": f"{group}/{version}" if group
                else version, "resources": items}
