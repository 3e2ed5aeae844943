"""A more realistic Kubernetes API for operator tests: kmock 0.8's emulator with the object
semantics a real API server has and kmock lacks (measured in the research notes, k8s.md §1).

:class:`RealisticEmulator` serves every *declared* resource itself (create, get, list, watch,
merge/JSON patch, PUT, delete) on kmock's object store and event buses, so ``kmock.objects`` and
kmock's discovery keep working. Added semantics:

- ``metadata.uid``, ``creationTimestamp``, ``generation`` (1 on create, +1 when anything but
  metadata and status changes), ``resourceVersion`` (one global counter; lists carry it too);
- the status subresource split: the main endpoint ignores ``status`` (and drops it on create), the
  ``/status`` endpoint changes nothing but ``status``;
- optimistic concurrency: PUT or merge patch with a stale ``metadata.resourceVersion`` -> 409; a
  failed JSON-patch ``test`` -> 422 (what kopf expects); a no-op write does not bump the version;
- PUT (replace) of objects and of the status subresource (kmock answers 404);
- equality, inequality, existence and set-based label selectors, ``metadata.name``/``namespace``
  field selectors, on list and watch;
- watches from a ``resourceVersion`` (objects changed since, then live events) ending after
  ``timeoutSeconds``; ``kind: XList`` on lists (kubectl needs it);
- deletion with finalizers (``deletionTimestamp``, removal once they are gone) and background
  garbage collection of dependents by ``ownerReferences`` uid;
- ``generateName``, and ``stringData`` of Secrets folded into base64 ``data``;
- mutating admission hooks (``admission_hooks``: what a webhook such as Kueue's does on create)
  and a log of writes to named objects (``writes``, with the client's User-Agent);
- ``/api/v1/namespaces`` parsed as the namespaces resource (a kmock 0.8 parser bug answers 500);
- 415 for a create or replace whose body has no JSON/YAML Content-Type (as an API server does).

Not emulated: admission, schema validation/defaulting/pruning, server-side apply, strategic merge
(treated as a merge patch), watch bookmarks and 410 Gone, controllers (no Job ever runs here:
tests play the Jobs), namespace lifecycle. This touches kmock internals (``_objects``,
``_buses``, ``_resources``) and may need changes on kmock upgrades.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import itertools
import json
import re
import secrets
import uuid
from datetime import datetime, timezone
from typing import Any

import aiohttp.web
import jsonpatch
from kmock._internal import k8s, parsing, references
from kmock._internal.dicts import merge_patch_dict

_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock 0.8 reads ``/api/v1/namespaces[/NAME[/status]]`` as a namespace prefix without a
    resource (``POST /api/v1/namespaces`` fails with 500): there, ``namespaces`` is the resource."""
    parts = path.strip("/").split("/")
    if (
        len(parts) in (3, 4, 5)
        and parts[0] == "api"
        and parts[2] == "namespaces"
        and (len(parts) < 5 or parts[4] in ("status", "finalize"))
    ):
        return parsing.ParsedPath(
            group="",
            version=parts[1],
            plural="namespaces",
            namespace=None,
            name=parts[3] if len(parts) > 3 else None,
            subresource=parts[4] if len(parts) > 4 else None,
        )
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path  # kmock's request parser looks it up at call time

_SYSTEM_META = ("uid", "creationTimestamp", "generation", "resourceVersion", "deletionTimestamp", "namespace", "name")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _content(obj: dict[str, Any]) -> dict[str, Any]:
    """What ``generation`` counts: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


_REQ = re.compile(r"^\s*(!)?\s*([A-Za-z0-9_./-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9_.-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def parse_selector(text: str | None) -> list[tuple[str, str, Any]]:
    """``a=b,c!=d,e,!f,g in (x,y),h notin (z)`` -> [(op, key, value)]."""
    if not text:
        return []
    parts, depth, cur = [], 0, ""
    for ch in text:  # split on commas outside parentheses
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        m = _REQ.match(p)
        if not m:
            raise ValueError(f"unable to parse requirement: {p!r}")
        neg, key, op, val, setop, vals = m.groups()
        if setop:
            out.append((setop, key, {v.strip() for v in vals.split(",") if v.strip()}))
        elif op:
            out.append(("!=" if op == "!=" else "=", key, val))
        else:
            out.append(("!exists" if neg else "exists", key, None))
    return out


def selector_matches(labels: dict[str, str], reqs: list[tuple[str, str, Any]]) -> bool:
    for op, key, val in reqs:
        have = key in labels
        v = labels.get(key)
        if op == "=":
            ok = have and v == val
        elif op == "!=":
            ok = not have or v != val
        elif op == "exists":
            ok = have
        elif op == "!exists":
            ok = not have
        elif op == "in":
            ok = have and v in val
        else:  # notin
            ok = not have or v not in val
        if not ok:
            return False
    return True


class ApiError(k8s.KubernetesError):
    pass


def _error(status: int, reason: str, message: str) -> ApiError:
    return ApiError(status=status, reason=reason, message=message, details={})


class RealisticEmulator(k8s.KubernetesEmulator):
    """See the module docstring. Use like kmock's emulator; declare resources with
    ``kmock.resources[...] = kmock.ResourceInfo(..., subresources={'status'})``."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = itertools.count(1)
        self._last_rv = 0
        #: mutating admission, as webhooks do it: ``hook(resource, object)`` changes an object
        #: before a create stores it (runs in the server's event loop: no API calls from a hook)
        self.admission_hooks: list[Any] = []
        #: ``(method, plural, namespace, name, User-Agent)`` of every write to a named object
        self.writes: list[tuple[str, str, str | None, str, str]] = []

    # --- plumbing ------------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._last_rv = next(self._rv)
        return str(self._last_rv)

    def _info(self, res: references.resource):
        try:
            return self._resources[res]
        except KeyError:
            return None

    def _live(self, key) -> dict[str, Any] | None:
        if key in self._objects and not self._objects[key].deleted:
            return copy.deepcopy(self._objects[key].raw)
        return None

    def _kind(self, res: references.resource) -> str:
        info = self._info(res)
        return info.kind if info is not None and info.kind else (res.plural or "").capitalize()

    async def _emit(self, res: references.resource, type_: str, obj: dict[str, Any]) -> None:
        await self._buses[res].put({"type": type_, "object": copy.deepcopy(obj)})

    async def _store(self, res, key, obj: dict[str, Any], type_: str) -> dict[str, Any]:
        if key in self._objects:
            self._objects[key].create(obj)  # appends a version to the object's history
        else:
            self._objects[key] = obj
        await self._emit(res, type_, obj)
        return obj

    async def _remove(self, res, key, obj: dict[str, Any]) -> None:
        self._objects[key].delete()
        await self._emit(res, "DELETED", obj)
        await self._collect_garbage(obj["metadata"].get("uid"))

    async def _collect_garbage(self, owner_uid: str | None) -> None:
        """Background cascading deletion: dependents whose ownerReferences name ``owner_uid``."""
        if not owner_uid:
            return
        for key, o in list(self._objects.items()):
            if o.deleted:
                continue
            meta = o.raw.get("metadata") or {}
            if any(r.get("uid") == owner_uid for r in meta.get("ownerReferences") or []):
                await self._delete_object(key[0], key, o.raw)

    async def _delete_object(self, res, key, cur: dict[str, Any]) -> dict[str, Any]:
        meta = cur["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                new = copy.deepcopy(cur)
                new["metadata"]["deletionTimestamp"] = _now()
                new["metadata"]["generation"] = int(meta.get("generation") or 0) + 1
                new["metadata"]["resourceVersion"] = self._next_rv()
                return await self._store(res, key, new, "MODIFIED")
            return cur
        cur = copy.deepcopy(cur)
        cur["metadata"]["resourceVersion"] = self._next_rv()
        await self._remove(res, key, cur)
        return cur

    # --- request handling ----------------------------------------------------------------------

    async def _handle(self, request):  # noqa: C901 - one dispatch table
        res = request.resource
        if res is None or not res.plural or self._info(res) is None:
            return await super()._handle(request)  # discovery, undeclared resources: kmock as is
        try:
            method = request.method.value if hasattr(request.method, "value") else str(request.method)
            sub = request.subresource
            if sub not in (None, "status"):
                raise _error(404, "NotFound", f"subresource {sub!r} is not served here")
            if method == "GET" and request.params.get("watch") in ("true", "1"):
                return await self._watch(request)
            if method == "GET" and request.name is None:
                return await self._list(request)
            ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
            if method in ("POST", "PUT") and ctype not in ("application/json", "application/yaml"):
                # like an API server: a body needs its media type (kubernetes-client 37 sends none
                # on creates and replaces unless told)
                raise _error(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format ({ctype!r}) - "
                    "accepted media types include: application/json, application/yaml",
                )
            if method in ("PATCH", "PUT", "DELETE") and request.name is not None:
                self.writes.append(
                    (
                        method,
                        request.resource.plural,
                        request.namespace,
                        request.name,
                        request.headers.get("User-Agent") or "",
                    )
                )
            async with self._lock:
                if method == "GET":
                    body, status = self._get(request), 200
                elif method == "POST" and request.name is None:
                    body, status = await self._create(request), 201
                elif method in ("PATCH", "PUT") and request.name is not None:
                    body, status = await self._update(request, method), 200
                elif method == "DELETE" and request.name is not None:
                    body, status = await self._delete(request), 200
                else:
                    raise _error(405, "MethodNotAllowed", f"{method} is not supported on this path")
            return aiohttp.web.json_response(body, status=status)
        except k8s.KubernetesError as e:
            return await self._render_error(e)

    def _key(self, request, name: str | None = None):
        info = self._info(request.resource)
        ns = request.namespace if (info is None or info.namespaced is not False) else None
        return (request.resource, ns, name or request.name)

    def _get(self, request) -> dict[str, Any]:
        cur = self._live(self._key(request))
        if cur is None:
            raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        return cur

    async def _create(self, request) -> dict[str, Any]:
        res = request.resource
        obj = copy.deepcopy(request.data) if isinstance(request.data, dict) else None
        if obj is None:
            raise _error(400, "BadRequest", "the body must be a JSON object")
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        key = self._key(request, meta["name"])
        if self._live(key) is not None:
            raise _error(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists')
        if key[1] is not None:
            meta["namespace"] = key[1]
        info = self._info(res)
        if "status" in (info.subresources or ()):
            obj.pop("status", None)
        if res.plural == "secrets" and res.group == "" and obj.get("stringData"):
            data = obj.setdefault("data", {})
            for k, v in obj.pop("stringData").items():
                data[k] = base64.b64encode(str(v).encode()).decode()
        for hook in self.admission_hooks:
            hook(res, obj)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1, resourceVersion=self._next_rv())
        for k in ("deletionTimestamp", "generateName"):
            meta.pop(k, None)
        return await self._store(res, key, obj, "ADDED")

    async def _update(self, request, method: str) -> dict[str, Any]:
        res, key = request.resource, self._key(request)
        cur = self._live(key)
        if cur is None:
            raise _error(404, "NotFound", f'{res.plural} "{request.name}" not found')
        data = request.data
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        if method == "PUT":
            if not isinstance(data, dict):
                raise _error(400, "BadRequest", "the body must be a JSON object")
            want = (data.get("metadata") or {}).get("resourceVersion")
            if want and want != cur["metadata"]["resourceVersion"]:
                raise _error(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.plural} "{request.name}": '
                    "the object has been modified; please apply your changes to the latest version and try again",
                )
            new = copy.deepcopy(data)
        elif ctype == "application/json-patch+json":
            if not isinstance(data, list):
                raise _error(400, "BadRequest", "a JSON patch is a list of operations")
            try:
                new = jsonpatch.apply_patch(copy.deepcopy(cur), data, in_place=False)
            except jsonpatch.JsonPatchTestFailed as e:
                raise _error(
                    422, "Invalid", f"the server rejected our request due to an error in our request: {e}"
                ) from None
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise _error(422, "Invalid", str(e)) from None
        elif ctype in (
            "application/merge-patch+json",
            "application/strategic-merge-patch+json",
            "application/json",
            "",
        ):
            if not isinstance(data, dict):
                raise _error(400, "BadRequest", "a merge patch is a JSON object")
            want = (data.get("metadata") or {}).get("resourceVersion")
            if want and want != cur["metadata"]["resourceVersion"]:
                raise _error(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.plural} "{request.name}": the object has been modified',
                )
            new = merge_patch_dict(copy.deepcopy(cur), data)
        else:
            raise _error(415, "UnsupportedMediaType", f"the content type {ctype!r} is not supported here")
        info = self._info(res)
        has_status = "status" in (info.subresources or ())
        if request.subresource == "status":  # only status changes
            result = copy.deepcopy(cur)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
        else:
            result = copy.deepcopy(new)
            if has_status:  # the main endpoint ignores status
                if "status" in cur:
                    result["status"] = copy.deepcopy(cur["status"])
                else:
                    result.pop("status", None)
            meta = result.setdefault("metadata", {})
            for k in _SYSTEM_META:  # not writable by clients
                if k in cur["metadata"]:
                    meta[k] = cur["metadata"][k]
                else:
                    meta.pop(k, None)
            if _content(result) != _content(cur):
                meta["generation"] = int(cur["metadata"].get("generation") or 0) + 1
        if result == cur:
            return cur  # no-op: same resourceVersion, no event
        result["metadata"]["resourceVersion"] = self._next_rv()
        meta = result["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(res, key, result)
            return result
        return await self._store(res, key, result, "MODIFIED")

    async def _delete(self, request) -> dict[str, Any]:
        key = self._key(request)
        cur = self._live(key)
        if cur is None:
            raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        return await self._delete_object(request.resource, key, cur)

    def _selected(self, request) -> list[dict[str, Any]]:
        labels = parse_selector(request.params.get("labelSelector"))
        fields = dict(p.split("=", 1) for p in (request.params.get("fieldSelector") or "").split(",") if "=" in p)
        out = []
        for (r, ns, _name), o in self._objects.items():
            if r != request.resource or o.deleted:
                continue
            if request.namespace is not None and ns != request.namespace:
                continue
            raw = o.raw
            if not self._matches(raw, labels, fields):
                continue
            out.append(copy.deepcopy(raw))
        return out

    @staticmethod
    def _matches(raw: dict[str, Any], labels, fields: dict[str, str]) -> bool:
        meta = raw.get("metadata") or {}
        if not selector_matches(meta.get("labels") or {}, labels):
            return False
        for k, v in fields.items():
            k = k.rstrip("=")
            if k == "metadata.name" and meta.get("name") != v.lstrip("="):
                return False
            if k == "metadata.namespace" and meta.get("namespace") != v.lstrip("="):
                return False
        return True

    async def _list(self, request):
        try:
            async with self._lock:
                items = self._selected(request)
                rv = str(self._last_rv)
        except ValueError as e:
            raise _error(400, "BadRequest", str(e)) from None
        res = request.resource
        api_version = f"{res.group}/{res.version}" if res.group else res.version
        return aiohttp.web.json_response(
            {
                "apiVersion": api_version,
                "kind": f"{self._kind(res)}List",
                "metadata": {"resourceVersion": rv},
                "items": items,
            }
        )

    async def _watch(self, request):
        res = request.resource
        try:
            labels = parse_selector(request.params.get("labelSelector"))
        except ValueError as e:
            raise _error(400, "BadRequest", str(e)) from None
        fields = dict(p.split("=", 1) for p in (request.params.get("fieldSelector") or "").split(",") if "=" in p)
        since = (
            int(request.params.get("resourceVersion") or 0)
            if (request.params.get("resourceVersion") or "0").isdigit()
            else 0
        )
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        bus = self._buses[res]
        async with self._lock:  # snapshot + subscription under the writers' lock: no event is lost
            mark = await bus.mark()
            initial = [o for o in self._selected(request) if int(o["metadata"].get("resourceVersion") or 0) > since]
        resp = aiohttp.web.StreamResponse(status=200)
        resp.content_type = "application/json"
        try:
            await resp.prepare(request._raw_request)
            for o in initial:
                await resp.write(
                    json.dumps({"type": "ADDED" if since == 0 else "MODIFIED", "object": o}).encode() + b"\n"
                )

            async def follow():
                async for ev in bus.stream(since=mark):
                    obj = ev.get("object") or {}
                    if int((obj.get("metadata") or {}).get("resourceVersion") or 0) <= since:
                        continue
                    if (
                        request.namespace is not None
                        and (obj.get("metadata") or {}).get("namespace") != request.namespace
                    ):
                        continue
                    if not self._matches(obj, labels, fields):
                        continue
                    await resp.write(json.dumps(ev).encode() + b"\n")

            try:
                await asyncio.wait_for(follow(), timeout)
            except asyncio.TimeoutError:
                pass
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away
        finally:
            await bus.unmark(mark)
        return resp
