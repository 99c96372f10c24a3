"""The `bij-api` HTTP server (aiohttp): the OpenAI Files and Batches endpoints the `openai` SDK calls.

    POST   /v1/files                  upload (multipart: file, purpose=batch), streamed to storage
    GET    /v1/files                  list (purpose, after, limit, order)
    GET    /v1/files/{id}             retrieve
    GET    /v1/files/{id}/content     download, streamed from storage
    DELETE /v1/files/{id}             delete an uploaded file
    POST   /v1/batches                create: a BatchInferenceJob in the caller's namespace
    GET    /v1/batches                list (after, limit), newest first
    GET    /v1/batches/{id}           retrieve, status and request counts live from the bij
    POST   /v1/batches/{id}/cancel    cancel: spec.cancel, the finished rows published
    GET    /v1/models                 the models lines may name: the model map's entries and their adapters
    GET    /v1/models/{id}            retrieve one

Every /v1 request carries a service-account token (`auth`); its namespace holds the caller's files
and batches, and another namespace's ids answer 404. Bodies, form fields and queries are parsed by
the models of `bodies`. Every error, aiohttp's own 404 and 405 and a bug's 500 too, is OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``, `errors` says which status each cause gets).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime as dt
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml
from aiohttp import BodyPartReader, web
from kubernetes.client import ApiException

from bij.api.auth import Authorizer, Caller
from bij.api.batches import (
    ANNOTATION,
    CANCELLING_AT,
    LABEL,
    batch_object,
    batch_of_file,
    bij_name,
    record,
    status_of,
    webhook_notify,
)
from bij.api.bodies import CreateBatch, ListFilesQuery, ListQuery, Purpose, UploadForm, parse
from bij.api.errors import (
    ApiError,
    BadRequest,
    Conflict,
    MethodNotAllowed,
    NotFoundError,
    ServerError,
    TooLarge,
    classify,
    kube_message,
)
from bij.api.files import MAX_MODELS, FileStore, new_id
from bij.api.models import ModelMap, ModelMapError, job_doc
from bij.contract import manifest as manifest_lists
from bij.contract.codes import API_GROUP, OPENAI_ENDPOINTS, PLURAL
from bij.contract.manifest import Manifest, ManifestFile
from bij.contract.spec import API_VERSION, SpecError, parse_job
from bij.storage import NotFound

log = logging.getLogger("bij.api")
FINAL = ("completed", "failed", "expired", "cancelled")
MANIFESTS_KEPT = 4096  # ended batches' manifests kept in memory

class Kube:
    """The few API calls `bij-api` makes as itself (its ServiceAccount, or the kubeconfig)."""

    def __init__(self, api: Any):
        import kubernetes

        self.api = api
        self.custom = kubernetes.client.CustomObjectsApi(api)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client import ApiException

        try:
            return dict(self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
        return dict(self.custom.create_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, doc))

    def patch(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return dict(self.custom.patch_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name, patch))

    def list(self, namespace: str) -> list[dict[str, Any]]:
        out = self.custom.list_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, label_selector=LABEL)
        return [dict(i) for i in out.get("items") or []]


class Cut(Exception):
    """A streamed response that failed after its status was sent: the connection is closed, the client
    sees a body shorter than its Content-Length."""


def _http_error(request: web.Request, e: web.HTTPException) -> ApiError:
    """aiohttp's own refusals (no such route, a method the route does not take, a body too large)."""
    where = f"{request.method} {request.path}"
    if e.status == 404:
        return NotFoundError(f"{where}: no such route")
    if e.status == 405:
        return MethodNotAllowed(f"{where}: the method is not allowed here (allowed: {e.headers.get('Allow', '')})",
                                headers={"Allow": e.headers.get("Allow", "")})
    if e.status == 413:
        return TooLarge(f"{where}: {e.text or e.reason}")
    err = ApiError(f"{where}: {e.reason}")
    err.status, err.type = e.status, "invalid_request_error" if e.status < 500 else "server_error"
    return err


@web.middleware
async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    """Every failure as OpenAI's error object; a response already under way (a download) is cut off
    instead, as its status has been sent."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = _http_error(request, e)
    except Cut:
        raise
    except Exception as e:  # noqa: BLE001 - classified: an outage, a storage object gone, else a bug
        found = classify(e)
        if found is None:
            log.exception("%s %s failed", request.method, request.path)
            found = ServerError(f"{request.method} {request.path}: the server failed; its log says why")
        elif found.status >= 500:
            log.warning("%s %s: %d %s", request.method, request.path, found.status, found)
        err = found
    return web.json_response(err.body(), status=err.status, headers=err.headers)


class Api:
    """The handlers, over a `FileStore`, a `ModelMap`, an `Authorizer` and `Kube`."""

    def __init__(self, files: FileStore, models: ModelMap, auth: Authorizer, kube: Kube, s3: dict[str, str],
                 notify: list[dict[str, Any]] | None = None):
        self.files, self.models, self.auth, self.kube, self.s3 = files, models, auth, kube, s3
        # The webhooks every batch tells when it ends (--webhooks, `batches.webhook_notify`): its bij's spec.notify.
        self.notify = notify or []
        # Ended batches' manifests, by URI: a published manifest never changes (a stopped bij never
        # publishes again, an output URI belongs to one bij), so each is read once.
        self.manifests: dict[str, Manifest] = {}
        self.started = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[errors])
        app.add_routes([
            web.get("/healthz", self.healthz),
            web.post("/v1/files", self.create_file),
            web.get("/v1/files", self.list_files),
            web.get("/v1/files/{id}", self.retrieve_file),
            web.get("/v1/files/{id}/content", self.file_content),
            web.delete("/v1/files/{id}", self.delete_file),
            web.post("/v1/batches", self.create_batch),
            web.get("/v1/batches", self.list_batches),
            web.get("/v1/batches/{id}", self.retrieve_batch),
            web.post("/v1/batches/{id}/cancel", self.cancel_batch),
            web.get("/v1/models", self.list_models),
            web.get("/v1/models/{id:.+}", self.retrieve_model),
        ])
        return app

    async def caller(self, request: web.Request) -> Caller:
        return await asyncio.to_thread(self.auth.caller, request.headers.get("Authorization"))

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    # --- files ----------------------------------------------------------------------------------

    async def create_file(self, request: web.Request) -> web.Response:
        who = await self.caller(request)
        if not request.content_type.startswith("multipart/"):
            raise BadRequest("upload a file as multipart/form-data with fields file and purpose", "file",
                             "invalid_type")
        try:
            reader = await request.multipart()
        except (ValueError, AssertionError) as e:  # no boundary, or not multipart after all
            raise BadRequest(f"the upload is not readable multipart/form-data: {e}", "file", "invalid_type") from None
        fields: dict[str, str] = {}
        obj: dict[str, Any] | None = None
        try:
            while True:
                part = await reader.next()
                if part is None:
                    break
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    fields["purpose"] = await part.text()
                    parse(Purpose, {"purpose": fields["purpose"]}, "upload form")  # refused before the file is kept
                elif part.name == "file":
                    if obj is not None:
                        raise BadRequest("one file per upload: this one has two file fields", "file")
                    fields["file"] = part.filename or "upload.jsonl"
                    obj = await self.files.upload(who.namespace, fields["file"], "batch", _chunks(part))
                else:  # a form field OpenAI's SDK may send that this server has no use for (expires_after)
                    await part.release()
            parse(UploadForm, fields, "upload form")
            assert obj is not None  # UploadForm requires the file
        except BaseException:
            if obj is not None:  # a refused upload keeps nothing, whichever part came first
                await asyncio.to_thread(self.files.delete, who.namespace, obj["id"])
            raise
        log.info("%s uploaded %s (%d bytes)", who.user, obj["id"], obj["bytes"])
        return web.json_response(obj)

    async def list_files(self, request: web.Request) -> web.Response:
        who = await self.caller(request)
        query = parse(ListFilesQuery, dict(request.query), "query")
        items = [_file_object(m) for m in await asyncio.to_thread(self.files.records, who.namespace)
                 if query.purpose in (None, m.get("purpose"))]
        if query.order == "asc":
            items.reverse()
        return web.json_response(_page(items, query))

    async def _file(self, who: Caller, file_id: str) -> tuple[dict[str, Any], list[str]]:
        """The File object of `file_id` in the caller's namespace and the storage URIs of its bytes."""
        made = batch_of_file(file_id)
        if made is not None:
            batch_id, kind = made
            bij = await self._bij(who, batch_id)
            manifest = await self._manifest(bij)
            if manifest is None:
                raise NotFoundError(f"no file {file_id}: batch {batch_id} has not ended")
            base = manifest.output_uri.rstrip("/") + "/"
            key = "files" if kind == "output" else "errorFiles"
            listed = await asyncio.to_thread(self._listed, manifest, key, base)
            if not listed:
                raise NotFoundError(f"no file {file_id}: batch {batch_id} has no {kind} rows")
            obj = {"id": file_id, "object": "file", "bytes": sum(f.bytes for f in listed),
                   "created_at": batch_object(bij)["completed_at"] or batch_object(bij)["created_at"],
                   "filename": f"{batch_id}_{kind}.jsonl", "purpose": "batch_output", "status": "processed",
                   "expires_at": None, "status_details": None}
            if any(f.path.endswith(".zst") for f in listed):
                raise BadRequest(f"{file_id} is stored compressed; this server serves plain JSON lines only")
            return obj, [base + f.path for f in listed]
        meta = await asyncio.to_thread(self.files.meta, who.namespace, file_id)
        if meta is None:
            raise NotFoundError(f"no file {file_id}")
        return _file_object(meta), [self.files.content_uri(who.namespace, file_id)]

    async def retrieve_file(self, request: web.Request) -> web.Response:
        who = await self.caller(request)
        obj, _ = await self._file(who, request.match_info["id"])
        return web.json_response(obj)

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        who = await self.caller(request)
        obj, uris = await self._file(who, request.match_info["id"])
        chunks = self.files.stream(uris)
        try:
            first = await anext(chunks, b"")  # a file gone or storage down is answered before the status
            resp = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
            resp.content_length = obj["bytes"]
            await resp.prepare(request)
            try:
                await resp.write(first)
                async for data in chunks:
                    await resp.write(data)
                await resp.write_eof()
            except Exception as e:
                log.warning("%s %s: cut off after its status was sent: %r", request.method, request.path, e)
                raise Cut(str(e)) from e
        finally:
            await chunks.aclose()
        return resp

    async def delete_file(self, request: web.Request) -> web.Response:
        who = await self.caller(request)
        file_id = request.match_info["id"]
        if batch_of_file(file_id) is not None:
            raise BadRequest(f"{file_id} is a batch's output: it goes with the batch's output folder", "file_id")
        if await asyncio.to_thread(self.files.meta, who.namespace, file_id) is None:
            raise NotFoundError(f"no file {file_id}")
        await asyncio.to_thread(self.files.delete, who.namespace, file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    # --- models ---------------------------------------------------------------------------------

    def _model_object(self, name: str) -> dict[str, Any]:
        """OpenAI's Model object; an adapter names its base model as ``parent`` (as vLLM's server does)."""
        found = self.models.resolve(name)
        if found is None:
            raise NotFoundError(f"no model {name}: known models: {', '.join(self.models.names) or 'none'}")
        key, adapter = found
        obj: dict[str, Any] = {"id": name, "object": "model", "created": self.started, "owned_by": "bij"}
        if adapter is not None:
            obj["parent"] = key
        return obj

    async def list_models(self, request: web.Request) -> web.Response:
        await self.caller(request)
        return web.json_response({"object": "list", "data": [self._model_object(n) for n in self.models.names]})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        await self.caller(request)
        return web.json_response(self._model_object(request.match_info["id"]))

    # --- batches --------------------------------------------------------------------------------

    def _listed(self, manifest: Manifest, key: str, base: str) -> list[ManifestFile]:
        """One of a manifest's file lists, read from its parts where it has them (`contract.manifest`)."""
        return manifest_lists.listed(manifest, key, lambda path: self.files.store.read_bytes(base + path))

    async def _manifest(self, bij: dict[str, Any]) -> Manifest | None:
        """The manifest of an ended batch (completed, cancelled or expired), else None."""
        uri = (bij.get("status") or {}).get("manifestUri")
        if not uri or status_of(bij) not in FINAL:
            return None
        if uri not in self.manifests:
            if len(self.manifests) >= MANIFESTS_KEPT:
                self.manifests.pop(next(iter(self.manifests)))
            self.manifests[uri] = Manifest.parse(await asyncio.to_thread(self.files.store.read_bytes, uri), uri)
        return self.manifests[uri]

    async def _batch(self, bij: dict[str, Any]) -> dict[str, Any]:
        """The Batch object of `bij`, with its usage once it has ended (none once its output folder was
        removed: the batch is still there to list and retrieve)."""
        try:
            manifest = await self._manifest(bij)
        except NotFound:
            manifest = None
        return batch_object(bij, manifest)

    async def _bij(self, who: Caller, batch_id: str) -> dict[str, Any]:
        name = bij_name(batch_id)
        bij = await asyncio.to_thread(self.kube.get, who.namespace, name) if name else None
        if bij is None or LABEL not in ((bij.get("metadata") or {}).get("labels") or {}) or \
                record(bij).get("id") != batch_id:
            raise NotFoundError(f"no batch {batch_id}")
        return bij

    async def create_batch(self, request: web.Request) -> web.Response:
        who = await self.caller(request)
        try:
            data = await request.json()
        except ValueError as e:
            raise BadRequest(f"the request body is not JSON: {e}", None, "invalid_json") from None
        body = parse(CreateBatch, data, "request body")
        endpoint, window, file_id = body.endpoint, body.completion_window, body.input_file_id
        meta = await asyncio.to_thread(self.files.meta, who.namespace, file_id)
        if meta is None:
            raise BadRequest(f"input_file_id: no file {file_id!r} in this namespace", "input_file_id")
        if meta.get("purpose") != "batch":
            raise BadRequest(f"input_file_id: {file_id} has purpose {meta.get('purpose')!r}, not batch",
                             "input_file_id")
        elsewhere = sorted(u for u in meta.get("urls") or [] if u != endpoint)
        if elsewhere:
            first = (meta.get("url_lines") or {}).get(elsewhere[0])
            where = f"line {first}" if first else "a line"
            raise BadRequest(f"input file {file_id}: {where} asks for {elsewhere[0]}, but the batch's endpoint is "
                             f"{endpoint}: every line's url must be the batch's endpoint", "input_file_id")
        key = self._model_of(file_id, meta)
        template = self.models.template(key)
        assert template is not None
        batch_id = new_id("batch_")
        # created_ns orders the list (the bij's creationTimestamp has whole seconds).
        rec = {"id": batch_id, "endpoint": endpoint, "input_file_id": file_id, "completion_window": window,
               "metadata": body.metadata or {}, "model": key, "lines": meta.get("lines", 0),
               "created_ns": time.time_ns()}
        doc = job_doc(bij_name(batch_id) or "", who.namespace, template,
                      input_uri=self.files.content_uri(who.namespace, file_id),
                      output_uri=self.files.batch_output(who.namespace, batch_id), task=OPENAI_ENDPOINTS[endpoint],
                      deadline_seconds=body.deadline_seconds, served_name=key, labels={LABEL: "true"},
                      annotations={ANNOTATION: json.dumps(rec, sort_keys=True)})
        if self.notify:
            doc["spec"]["notify"] = copy.deepcopy(self.notify)
        if self.s3:  # the workers reach the files prefix as the server does
            doc["spec"]["storage"] = {**doc["spec"].get("storage", {}),
                                      "s3": {**doc["spec"].get("storage", {}).get("s3", {}), **self.s3}}
        try:
            parse_job(doc)
        except SpecError as e:
            raise BadRequest(f"model {key!r} cannot serve {endpoint}: {'; '.join(e.problems)}",
                             "endpoint") from None
        try:
            made = await asyncio.to_thread(self.kube.create, who.namespace, doc)
        except ApiException as e:
            # Admission (CEL rules, a webhook, a quota) or the namespace refused the bij: the caller's to
            # change, with the API server's words; an outage or throttling is classified as any other.
            if e.status in (400, 403, 404, 409, 422):
                raise BadRequest(f"the Kubernetes API server refused batch {batch_id}'s BatchInferenceJob: "
                                 f"{kube_message(e)}", None, "invalid_request") from None
            raise
        log.info("%s created %s (bij %s/%s, model %s)", who.user, batch_id, who.namespace, doc["metadata"]["name"],
                 key)
        return web.json_response(batch_object(made))

    def _model_of(self, file_id: str, meta: dict[str, Any]) -> str:
        """The model map entry that runs a file's lines: each line names it (its base model) or one of
        its adapters; a name served nowhere here, or names of two entries, refuse the batch (400 naming
        the first line that says so)."""
        named = list(meta.get("models") or [])
        first: dict[str, int] = meta.get("model_lines") or {}

        def line(model: str) -> str:
            return f"line {first[model]}" if model in first else "a line"

        if not named:
            raise BadRequest(f"input file {file_id}: no line names a model (body.model)", "input_file_id")
        if meta.get("more_models"):
            raise BadRequest(f"input file {file_id}: line {meta['more_models']} names a model past the "
                             f"{MAX_MODELS} different ones one file may name", "input_file_id")
        entries: dict[str, str] = {}  # entry key -> the first name of it the lines use
        for model in sorted(named, key=lambda m: first.get(m, 0)):
            found = self.models.resolve(model)
            if found is None:
                raise BadRequest(f"input file {file_id}: {line(model)} names model {model!r} (body.model), which "
                                 f"is not served here; known models: {', '.join(self.models.names) or 'none'}",
                                 "model")
            entries.setdefault(found[0], model)
        if len(entries) > 1:
            (a, first_name), (b, second) = list(entries.items())[:2]
            raise BadRequest(f"input file {file_id}: a batch runs one model with its adapters; {line(first_name)} "
                             f"names {first_name!r} (of model {a!r}), {line(second)} names {second!r} (of model "
                             f"{b!r})", "model")
        return next(iter(entries))

    async def retrieve_batch(self, request: web.Request) -> web.Response:
        who = await self.caller(request)
        return web.json_response(await self._batch(await self._bij(who, request.match_info["id"])))

    async def list_batches(self, request: web.Request) -> web.Response:
        who = await self.caller(request)
        query = parse(ListQuery, dict(request.query), "query")
        bijs = await asyncio.to_thread(self.kube.list, who.namespace)
        ours = [b for b in bijs if ANNOTATION in (b["metadata"].get("annotations") or {})]
        ours.sort(key=lambda b: (record(b).get("created_ns", 0), b["metadata"].get("creationTimestamp", "")),
                  reverse=True)
        return web.json_response(_page([await self._batch(b) for b in ours], query))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        who = await self.caller(request)
        batch_id = request.match_info["id"]
        bij = await self._bij(who, batch_id)
        status = batch_object(bij)["status"]
        if status in ("completed", "failed", "expired"):
            raise Conflict(f"batch {batch_id} is {status}: it cannot be cancelled")
        if status not in ("cancelling", "cancelled"):
            now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            bij = await asyncio.to_thread(self.kube.patch, who.namespace, bij["metadata"]["name"],
                                          {"metadata": {"annotations": {CANCELLING_AT: now}},
                                           "spec": {"cancel": True}})
            log.info("%s cancelled %s", who.user, batch_id)
        return web.json_response(batch_object(bij))


async def _chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while True:
        data = await part.read_chunk(1 << 20)
        if not data:
            return
        yield data


def _file_object(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta.get(k) for k in ("id", "object", "bytes", "created_at", "filename", "purpose", "status",
                                     "expires_at", "status_details")}


def _page(items: list[dict[str, Any]], query: ListQuery) -> dict[str, Any]:
    """One page of a list, OpenAI's cursor style: items after the id `after`, at most `limit` (1-100)."""
    after, limit = query.after, query.limit
    if after:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise BadRequest(f"after: no {after} in this list", "after", "invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def kube_client() -> Any:
    """In-cluster credentials (the pod's ServiceAccount), else the kubeconfig."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bij-api", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files-prefix", default=os.environ.get("BIJ_API_FILES_PREFIX"),
                   help="file:// or s3:// URI under which files and batch outputs are kept (env BIJ_API_FILES_PREFIX)")
    p.add_argument("--models", default=os.environ.get("BIJ_API_MODELS", "/etc/bij-api/models.yaml"),
                   help="the model map: model name -> bij template (YAML)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=int(os.environ.get("BIJ_API_PORT", "8000")))
    p.add_argument("--s3-endpoint-url", default=None, help="S3 endpoint of the files prefix (also given to workers)")
    p.add_argument("--s3-region", default=None, help="S3 region of the files prefix (also given to workers)")
    p.add_argument("--webhooks", default=os.environ.get("BIJ_API_WEBHOOKS"),
                   help="YAML file: webhooks told when a batch ends, [{url, secretRef: {name, key}, events: "
                        "[batch.completed, batch.failed, batch.cancelled, batch.expired]}] (env BIJ_API_WEBHOOKS); "
                        "the Secret lies in each batch's namespace")
    p.add_argument("--auth-cache-seconds", type=float, default=30.0,
                   help="how long a token's TokenReview and SubjectAccessReview verdict is kept")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run `bij-api` until SIGTERM/SIGINT."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=os.environ.get("BIJ_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.files_prefix or not args.files_prefix.startswith(("file://", "s3://")):
        print(f"bij-api: --files-prefix must be a file:// or s3:// URI, got {args.files_prefix!r}", file=sys.stderr)
        return 2
    try:
        models = ModelMap.load(args.models)
    except ModelMapError as e:
        print(f"bij-api: {e}", file=sys.stderr)
        return 2
    try:
        notify = webhook_notify(yaml.safe_load(Path(args.webhooks).read_text()), args.webhooks) if args.webhooks else []
    except (OSError, ValueError, yaml.YAMLError) as e:
        print(f"bij-api: --webhooks: {e}", file=sys.stderr)
        return 2
    s3 = {k: v for k, v in (("endpointUrl", args.s3_endpoint_url), ("region", args.s3_region)) if v}
    api = kube_client()
    server = Api(FileStore(args.files_prefix, s3 or None), models, Authorizer(api, ttl=args.auth_cache_seconds),
                 Kube(api), s3, notify)
    log.info("bij-api on %s:%d, files under %s, models: %s", args.host, args.port, args.files_prefix,
             ", ".join(models.names) or "none")
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
