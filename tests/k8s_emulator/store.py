"""The emulated API server's state: resources, objects, resource versions and watch history.

Everything here runs on the emulator's event loop thread, so there are no locks: HTTP
handlers, the Job controller and the test-facing facade all call in on that loop.
Behaviour copies the real server where the operator could tell the difference:
resourceVersion on every write (a global counter, as etcd's revision), generation bumps
on spec changes only, status subresources that ignore the other half of the object,
409 on duplicate names and stale resourceVersions, 404 for unknown namespaces,
finalizers, owner-reference garbage collection, and a bounded watch history (410 Gone
beyond it).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import datetime as dt
import random
import string
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from . import schema as schema_mod
from .builtin import job_admission
from .patching import PatchError, apply_patch
from .selectors import SelectorError, parse_field_selector, parse_label_selector

Obj = dict[str, Any]
ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """An error answered as a ``v1.Status`` with this HTTP code and reason."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def status(self) -> Obj:
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "details": self.details, "code": self.code}


@dataclasses.dataclass(frozen=True)
class Resource:
    """One served resource of one group/version, as discovery lists it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ALL_VERBS
    schema: dict[str, Any] | None = dataclasses.field(default=None, compare=False, hash=False)
    printer_columns: tuple[dict[str, Any], ...] = dataclasses.field(default=(), compare=False, hash=False)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str]:
        """Storage key: objects are shared by all versions of a resource."""
        return (self.group, self.plural)

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def kind_qualified(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind


BUILTIN_RESOURCES = (
    Resource("", "v1", "namespaces", "Namespace", False, "namespace", ("ns",), subresources=("status",)),
    Resource("", "v1", "events", "Event", True, "event", ("ev",)),
    Resource("batch", "v1", "jobs", "Job", True, "job", categories=("all",), subresources=("status",)),
    Resource("events.k8s.io", "v1", "events", "Event", True, "event", ("ev",)),
    Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False,
             "customresourcedefinition", ("crd", "crds"), subresources=("status",)),
)


@dataclasses.dataclass
class Change:
    """One write, as the watch history keeps it (with the previous state for selector moves)."""

    rv: int
    key: tuple[str, str]
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Obj | None


@dataclasses.dataclass(eq=False)
class Watcher:
    """One open watch request: its filters and the queue of events still to send."""

    key: tuple[str, str]
    namespace: str | None
    labels: Callable[[Any], bool]
    fields: Callable[[Any], bool]
    queue: asyncio.Queue[Obj | None] = dataclasses.field(default_factory=asyncio.Queue)

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels(meta.get("labels") or {}) and self.fields(obj)

    def event_for(self, change: Change) -> Obj | None:
        """The event this watcher sees: a selector that starts/stops matching is ADDED/DELETED."""
        now, before = self.matches(change.obj), self.matches(change.old)
        if change.type == "DELETED":
            kind = "DELETED" if before or now else None
        elif now and before:
            kind = "MODIFIED"
        elif now:
            kind = "ADDED"
        elif before:
            kind = "DELETED"
        else:
            kind = None
        return {"type": kind, "object": copy.deepcopy(change.obj)} if kind else None


Hook = Callable[[Resource, Obj, "Obj | None"], list[str]]


class Store:
    """All objects of the emulated cluster."""

    def __init__(self, history: int = 50_000):
        self.resources: dict[tuple[str, str, str], Resource] = {}
        self.objects: dict[tuple[str, str], dict[tuple[str, str], Obj]] = collections.defaultdict(dict)
        self.rv = 0
        self.history: collections.deque[Change] = collections.deque(maxlen=history)
        self.watchers: set[Watcher] = set()
        self.listeners: list[Callable[[Change], None]] = []
        # Per-resource admission (defaults + validation) for built-in kinds; CRDs use their schema.
        self.admission: dict[tuple[str, str], Hook] = {("batch", "jobs"): job_admission}
        for res in BUILTIN_RESOURCES:
            self.resources[(res.group, res.version, res.plural)] = res
        for ns in ("default", "kube-system"):
            self.create(self.resource("", "v1", "namespaces"), None, {"metadata": {"name": ns}})

    # --- resources -------------------------------------------------------------------------

    def resource(self, group: str, version: str, plural: str) -> Resource:
        res = self.resources.get((group, version, plural))
        if res is None:
            gv = f"{group}/{version}" if group else version
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({plural} {gv})")
        return res

    def resource_for(self, api_version: str, kind: str) -> Resource:
        group, _, version = api_version.rpartition("/")
        for res in self.resources.values():
            if res.group == group and res.version == version and res.kind == kind:
                return res
        raise ApiError(404, "NotFound", f"no matches for kind {kind!r} in version {api_version!r}")

    def _register_crd(self, crd: Obj) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for v in spec.get("versions") or []:
            if not v.get("served", True):
                continue
            res = Resource(
                group=spec["group"], version=v["name"], plural=names["plural"], kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular") or names["kind"].lower(),
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                subresources=tuple(sorted((v.get("subresources") or {}).keys())),
                schema=(v.get("schema") or {}).get("openAPIV3Schema"),
                printer_columns=tuple(v.get("additionalPrinterColumns") or ()),
            )
            self.resources[(res.group, res.version, res.plural)] = res

    def _unregister_crd(self, crd: Obj) -> None:
        spec = crd.get("spec") or {}
        plural = (spec.get("names") or {}).get("plural")
        for k in [k for k in self.resources if k[0] == spec.get("group") and k[2] == plural]:
            del self.resources[k]

    # --- reads -----------------------------------------------------------------------------

    def _bucket(self, res: Resource) -> dict[tuple[str, str], Obj]:
        return self.objects[res.key]

    def _ns(self, res: Resource, namespace: str | None) -> str:
        return (namespace or "") if res.namespaced else ""

    def _out(self, res: Resource, obj: Obj) -> Obj:
        out = copy.deepcopy(obj)
        out["apiVersion"] = res.api_version
        out["kind"] = res.kind
        return out

    def get(self, res: Resource, namespace: str | None, name: str) -> Obj:
        obj = self._bucket(res).get((self._ns(res, namespace), name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{res.qualified} "{name}" not found',
                           {"name": name, "group": res.group, "kind": res.plural})
        return self._out(res, obj)

    def list(self, res: Resource, namespace: str | None, label_selector: str | None = None,
             field_selector: str | None = None) -> tuple[list[Obj], str]:
        try:
            labels = parse_label_selector(label_selector)
            fields = parse_field_selector(field_selector)
        except SelectorError as e:
            raise ApiError(400, "BadRequest", str(e)) from None
        items = []
        for (ns, _), obj in sorted(self._bucket(res).items()):
            if res.namespaced and namespace and ns != namespace:
                continue
            if labels((obj.get("metadata") or {}).get("labels") or {}) and fields(obj):
                items.append(self._out(res, obj))
        return items, str(self.rv)

    def all_objects(self, res: Resource) -> Iterator[Obj]:
        for obj in list(self._bucket(res).values()):
            yield self._out(res, obj)

    # --- writes ----------------------------------------------------------------------------

    def _commit(self, res: Resource, type_: str, obj: Obj, old: Obj | None) -> Obj:
        self.rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        ns, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
        if type_ == "DELETED":
            self._bucket(res).pop((ns, name), None)
        else:
            self._bucket(res)[(ns, name)] = obj
        change = Change(self.rv, res.key, type_, self._out(res, obj), self._out(res, old) if old else None)
        self.history.append(change)
        for w in list(self.watchers):
            if w.key == res.key:
                event = w.event_for(change)
                if event is not None:
                    w.queue.put_nowait(event)
        for listener in list(self.listeners):
            listener(change)
        return self._out(res, obj)

    def _admit(self, res: Resource, obj: Obj, old: Obj | None) -> Obj:
        if res.schema is not None:
            obj, problems = schema_mod.admit(obj, res.schema)
        else:
            problems = []
        hook = self.admission.get(res.key)
        if hook is not None:
            problems += hook(res, obj, old)
        if problems:
            name = (obj.get("metadata") or {}).get("name", "")
            shown = problems[0] if len(problems) == 1 else "[" + ", ".join(problems) + "]"
            raise ApiError(422, "Invalid", f'{res.kind_qualified} "{name}" is invalid: {shown}', {
                "name": name, "group": res.group, "kind": res.kind,
                "causes": [{"reason": "FieldValueInvalid", "message": p, "field": p.split(":", 1)[0]}
                           for p in problems],
            })
        return obj

    def create(self, res: Resource, namespace: str | None, body: Obj) -> Obj:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of a create must be an object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if res.namespaced:
            ns = namespace or meta.get("namespace") or "default"
            if meta.get("namespace") and meta["namespace"] != ns:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match "
                                                  "the namespace sent on the request")
            if ("", ns) not in self.objects[("", "namespaces")]:
                raise ApiError(404, "NotFound", f'namespaces "{ns}" not found',
                               {"name": ns, "kind": "namespaces"})
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + "0123456789",
                                                                             k=5))
            else:
                raise ApiError(422, "Invalid", f"{res.kind_qualified} is invalid: metadata.name: Required value: "
                                               "name or generateName is required")
        key = (meta.get("namespace", ""), meta["name"])
        if key in self._bucket(res):
            raise ApiError(409, "AlreadyExists", f'{res.qualified} "{meta["name"]}" already exists',
                           {"name": meta["name"], "group": res.group, "kind": res.plural})
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        if "status" in res.subresources:
            # The status of a resource with a status subresource is the controller's, not the creator's.
            obj.pop("status", None)
        obj = self._admit(res, obj, None)
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_iso()
        meta["generation"] = 1
        for k in ("resourceVersion", "deletionTimestamp", "selfLink"):
            meta.pop(k, None)
        if res.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._register_crd(obj)
            established = {"type": "Established", "status": "True", "reason": "InitialNamesAccepted"}
            obj["status"] = {"conditions": [established], "acceptedNames": obj["spec"]["names"]}
        return self._commit(res, "ADDED", obj, None)

    def _current(self, res: Resource, namespace: str | None, name: str) -> Obj:
        obj = self._bucket(res).get((self._ns(res, namespace), name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{res.qualified} "{name}" not found',
                           {"name": name, "group": res.group, "kind": res.plural})
        return obj

    def _write(self, res: Resource, old: Obj, new: Obj, subresource: str | None) -> Obj:
        """Store `new` as the next version of `old`, keeping what this endpoint may not change."""
        if subresource not in (None, "status"):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({subresource})")
        if subresource == "status" and "status" not in res.subresources:
            raise ApiError(404, "NotFound", f"{res.qualified} has no status subresource")
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {res.qualified} '
                                            f'"{old["metadata"]["name"]}": the object has been modified; '
                                            "please apply your changes to the latest version and try again")
        if subresource == "status":
            result = copy.deepcopy(old)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
        else:
            result = copy.deepcopy(new)
            if "status" in res.subresources:
                if "status" in old:
                    result["status"] = copy.deepcopy(old["status"])
                else:
                    result.pop("status", None)
            meta = result.setdefault("metadata", {})
            for k in ("name", "namespace", "uid", "creationTimestamp", "generation", "deletionTimestamp"):
                if k in old["metadata"]:
                    meta[k] = old["metadata"][k]
                else:
                    meta.pop(k, None)
        result["apiVersion"], result["kind"] = res.api_version, res.kind
        result = self._admit(res, result, old)
        result["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if result == old:
            return self._out(res, old)  # a no-op write changes no resourceVersion and sends no event
        def content(o: Obj) -> Obj:
            return {k: v for k, v in o.items() if k not in ("metadata", "status", "apiVersion", "kind")}
        if content(result) != content(old):
            result["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        meta = result["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._remove(res, result, old)
        if res.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._register_crd(result)
        return self._commit(res, "MODIFIED", result, old)

    def replace(self, res: Resource, namespace: str | None, name: str, body: Obj,
                subresource: str | None = None) -> Obj:
        old = self._current(res, namespace, name)
        if (body.get("metadata") or {}).get("name", name) != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        return self._write(res, old, copy.deepcopy(body), subresource)

    def patch(self, res: Resource, namespace: str | None, name: str, content_type: str, body: Any,
              subresource: str | None = None) -> Obj:
        old = self._current(res, namespace, name)
        try:
            new = apply_patch(copy.deepcopy(old), content_type, body)
        except PatchError as e:
            reason = {400: "BadRequest", 415: "UnsupportedMediaType"}.get(e.code, "Invalid")
            raise ApiError(e.code, reason, str(e)) from None
        return self._write(res, old, new, subresource)

    def delete(self, res: Resource, namespace: str | None, name: str) -> Obj:
        old = self._current(res, namespace, name)
        if old["metadata"].get("finalizers"):
            if old["metadata"].get("deletionTimestamp"):
                return self._out(res, old)
            new = copy.deepcopy(old)
            new["metadata"]["deletionTimestamp"] = now_iso()
            return self._commit(res, "MODIFIED", new, old)
        return self._remove(res, copy.deepcopy(old), old)

    def _remove(self, res: Resource, final: Obj, old: Obj) -> Obj:
        out = self._commit(res, "DELETED", final, old)
        if res.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._unregister_crd(final)
        self._collect_garbage(final["metadata"]["uid"])
        if res.key == ("", "namespaces"):
            ns = final["metadata"]["name"]
            for other in list(self.resources.values()):
                if other.namespaced:
                    for (ons, oname) in [k for k in self._bucket(other) if k[0] == ns]:
                        if (ons, oname) in self._bucket(other):
                            self.delete(other, ons, oname)
        return out

    def _collect_garbage(self, owner_uid: str) -> None:
        """Background propagation: dependents whose every owner is gone are deleted."""
        live_uids = {o["metadata"]["uid"] for bucket in self.objects.values() for o in bucket.values()}
        seen: set[tuple[str, str]] = set()
        for res in list(self.resources.values()):
            if res.key in seen:
                continue
            seen.add(res.key)
            for (ns, name), obj in list(self._bucket(res).items()):
                owners = (obj.get("metadata") or {}).get("ownerReferences") or []
                uids = {o.get("uid") for o in owners}
                if owner_uid in uids and not (uids & live_uids):
                    if (ns, name) in self._bucket(res):
                        self.delete(res, ns, name)

    # --- watching --------------------------------------------------------------------------

    def watch(self, res: Resource, namespace: str | None, since: str | None,
              label_selector: str | None = None, field_selector: str | None = None) -> Watcher:
        """A registered watcher, its queue already holding the events after `since`."""
        try:
            w = Watcher(res.key, namespace if res.namespaced else None, parse_label_selector(label_selector),
                        parse_field_selector(field_selector))
        except SelectorError as e:
            raise ApiError(400, "BadRequest", str(e)) from None
        if since in (None, "", "0"):
            # No version: start with the current state as synthetic ADDED events.
            for obj in self.list(res, namespace, label_selector, field_selector)[0]:
                w.queue.put_nowait({"type": "ADDED", "object": obj})
        else:
            try:
                since_rv = int(since)
            except ValueError:
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {since!r}") from None
            oldest = self.history[0].rv if self.history else self.rv + 1
            if since_rv < oldest - 1 and since_rv < self.rv:
                raise ApiError(410, "Expired", f"too old resource version: {since_rv} ({oldest - 1})")
            for change in self.history:
                if change.rv > since_rv and change.key == res.key:
                    event = w.event_for(change)
                    if event is not None:
                        w.queue.put_nowait(event)
        self.watchers.add(w)
        return w

    def unwatch(self, w: Watcher) -> None:
        self.watchers.discard(w)
