"""A real Kubernetes CRD API server for the operator tests, and a proxy that puts it in front of kmock.

:class:`RealCrdServer` runs ``k8s.io/apiextensions-apiserver`` (the CRD half of kube-apiserver:
the same generic apiserver code, structural schemas, CEL rules, defaulting, pruning, status
subresource, resourceVersion conflicts, generation, finalizers, watches) on Debian's ``etcd``.
The two binaries come from ``tests/k8s_apiserver/build.sh`` (built from Debian sid's Go source
packages, cached outside the checkout). The server delegates authentication and authorization
to a kubeconfig's server: here a small stdlib HTTP server in this process that authenticates
every token and allows every request (TokenReview / SubjectAccessReview), and answers empty
lists for the informers the generic apiserver starts against its "core" cluster.

It serves only ``apiextensions.k8s.io`` and the custom resources. :class:`CompositeProxy` (aiohttp)
is what the operator and the tests talk to: ``/apis/mergepipe.io/...`` and
``/apis/apiextensions.k8s.io/...`` go to the real server, everything else (namespaces, Secrets,
Events, Jobs) to kmock; ``/apis`` merges kmock's groups with the real server's (asked per group:
it serves no ``/apis`` of its own). A cluster's garbage collector
(kube-controller-manager) is not part of either server: Jobs in kmock owned by a custom resource
are not collected when it goes (the operator deletes its Jobs itself).

Layout of the build cache (see build.sh): ``$MERGEPIPE_APISERVER_CACHE`` (default
``~/.cache/mergepipe-apiserver``) ``/current/bin/{apiextensions-apiserver,etcd}``;
``$MERGEPIPE_APISERVER_BIN`` names another folder holding both.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "tests" / "k8s_apiserver" / "build.sh"
#: The API groups the real server owns; everything else is kmock's.
REAL_GROUPS = ("mergepipe.io", "apiextensions.k8s.io")
TOKEN = "mergepipe-test"


def bin_dir() -> Path:
    """Where build.sh puts (or put) the binaries; they may be absent."""
    if os.environ.get("MERGEPIPE_APISERVER_BIN"):
        return Path(os.environ["MERGEPIPE_APISERVER_BIN"])
    cache = Path(os.environ.get("MERGEPIPE_APISERVER_CACHE") or Path.home() / ".cache" / "mergepipe-apiserver")
    return cache / "current" / "bin"


def binaries_present() -> bool:
    d = bin_dir()
    return all(os.access(d / b, os.X_OK) for b in ("apiextensions-apiserver", "etcd"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the delegated authn/authz "core" server ------------------------------------------------------


class _AuthHandler(BaseHTTPRequestHandler):
    """Authenticates every bearer token as an admin and allows every request; answers the
    informers of the generic apiserver with empty lists (it watches nothing here)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers.get("Content-Length") or 0)
        review = json.loads(self.rfile.read(n) or b"{}")
        if self.path.endswith("/tokenreviews"):
            review["status"] = {
                "authenticated": True,
                "user": {
                    "username": "mergepipe-test",
                    "uid": "0",
                    "groups": ["system:masters", "system:authenticated"],
                },
            }
        elif self.path.endswith("/subjectaccessreviews"):
            review["status"] = {"allowed": True, "reason": "mergepipe tests allow everything"}
        else:
            return self._send(
                404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
            )
        self._send(201, review)

    def do_GET(self) -> None:  # noqa: N802
        url = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(url.query)
        if q.get("sendInitialEvents", [""])[0] == "true":
            # a streaming list (client-go's WatchList): refused, so the informer falls back to
            # LIST + WATCH (what client-go does against servers without it)
            return self._send(
                400,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "reason": "BadRequest",
                    "message": "sendInitialEvents is not supported here",
                    "code": 400,
                },
            )
        if q.get("watch", [""])[0] in ("true", "1"):
            # a watch with no events, open until its timeout (an informer treats an early close
            # as an error), then ended; the informer reconnects
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            time.sleep(min(float(q.get("timeoutSeconds", ["60"])[0]), 60.0))
            try:
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass
            return
        if url.path in ("/api", "/apis", "/version"):
            return self._send(
                404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
            )
        # any list (the generic apiserver's informers on its "core" cluster: Services, flow
        # control, admission configuration, ...) is empty
        self._send(200, {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": []})


class _AuthServer(ThreadingHTTPServer):
    daemon_threads = True


# --- the real server ----------------------------------------------------------------------------


class RealCrdServer:
    """etcd + apiextensions-apiserver on free loopback ports, in a temporary folder.

    ``url`` is the HTTPS endpoint (self-signed certificate; use :meth:`request`, or ``ssl=False``
    with a bearer token of :data:`TOKEN`). Start/stop with ``with``; ``start`` raises
    ``RuntimeError`` (with the server's log tail) when it does not become ready in ``timeout``
    seconds.
    """

    def __init__(self, bins: Path | None = None) -> None:
        self.bins = bins or bin_dir()
        self.dir = Path(tempfile.mkdtemp(prefix="mergepipe-apiserver-"))
        self.procs: list[subprocess.Popen] = []
        self.auth: _AuthServer | None = None
        self.port = 0
        self._ctx = ssl.create_default_context()
        self._ctx.check_hostname = False
        self._ctx.verify_mode = ssl.CERT_NONE

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def version(self) -> str:
        v = self.bins.parent / "VERSIONS"
        return v.read_text().strip() if v.is_file() else "unknown"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.dir)
        self.procs.append(p)
        return p

    def log_tail(self, name: str, n: int = 3000) -> str:
        p = self.dir / f"{name}.log"
        return p.read_bytes()[-n:].decode(errors="replace") if p.is_file() else ""

    def start(self, timeout: float = 120.0) -> RealCrdServer:
        self.auth = _AuthServer(("127.0.0.1", 0), _AuthHandler)
        threading.Thread(target=self.auth.serve_forever, name="apiserver-auth", daemon=True).start()
        auth_url = f"http://127.0.0.1:{self.auth.server_address[1]}"
        kubeconfig = self.dir / "auth.kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "auth",
                    "clusters": [{"name": "auth", "cluster": {"server": auth_url}}],
                    "users": [{"name": "auth", "user": {"token": "auth"}}],
                    "contexts": [{"name": "auth", "context": {"cluster": "auth", "user": "auth"}}],
                }
            )
        )
        etcd_client, etcd_peer = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                str(self.bins / "etcd"),
                "--data-dir",
                str(self.dir / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_client}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd_client}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{etcd_peer}",
                "--log-level",
                "warn",
                "--quota-backend-bytes",
                str(1 << 30),
            ],
        )
        self.port = free_port()
        self._spawn(
            "apiserver",
            [
                str(self.bins / "apiextensions-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                f"--secure-port={self.port}",
                "--bind-address=127.0.0.1",
                f"--cert-dir={self.dir / 'certs'}",
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--authentication-skip-lookup",
                "--disable-admission-plugins=NamespaceLifecycle,MutatingAdmissionWebhook,ValidatingAdmissionWebhook,"
                "ValidatingAdmissionPolicy,MutatingAdmissionPolicy",
            ],
        )
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for p, name in zip(self.procs, ("etcd", "apiserver")):
                if p.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.log_tail(name)}")
            try:
                code, body = self.request("GET", "/readyz")
                if code == 200:
                    return self
                last = f"HTTP {code}: {body}"
            except OSError as e:
                last = str(e)
            time.sleep(0.5)
        tail = self.log_tail("apiserver")
        self.stop()
        raise RuntimeError(f"apiextensions-apiserver not ready after {timeout:.0f}s ({last}):\n{tail}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        self.procs.clear()
        if self.auth is not None:
            self.auth.shutdown()
            self.auth.server_close()
            self.auth = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RealCrdServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- plain HTTP calls -------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json", timeout: float = 30
    ) -> tuple[int, Any]:
        """``(HTTP status, parsed JSON body or text)``; errors are returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type, "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self._ctx) as r:
                code, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            code, raw = e.code, e.read()
        try:
            return code, json.loads(raw)
        except ValueError:
            return code, raw.decode(errors="replace")

    def apply_crd(self, crd: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
        """Create the CRD, or replace it (PUT with the current resourceVersion) when it exists;
        wait until it is Established. Raises AssertionError with the server's message when the
        server refuses it."""
        name = crd["metadata"]["name"]
        path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        code, cur = self.request("GET", f"{path}/{name}")
        if code == 200:
            new = dict(crd, metadata=dict(crd["metadata"], resourceVersion=cur["metadata"]["resourceVersion"]))
            code, out = self.request("PUT", f"{path}/{name}", new)
        else:
            code, out = self.request("POST", path, crd)
        if code not in (200, 201):
            raise AssertionError(
                f"CRD {name} refused: HTTP {code}: {out.get('message') if isinstance(out, dict) else out}"
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code, cur = self.request("GET", f"{path}/{name}")
            conds = {c["type"]: c for c in (cur.get("status") or {}).get("conditions") or []}
            if (
                conds.get("Established", {}).get("status") == "True"
                and conds.get("NamesAccepted", {}).get("status") == "True"
            ):
                # the storage of a new version is served a moment after Established
                g, v, plural = crd["spec"]["group"], crd["spec"]["versions"][0]["name"], crd["spec"]["names"]["plural"]
                if self.request("GET", f"/apis/{g}/{v}/{plural}")[0] == 200:
                    return cur
            time.sleep(0.2)
        raise AssertionError(f"CRD {name} not Established after {timeout:.0f}s: {cur.get('status')}")

    def delete_all(self, group: str, version: str, plurals: list[str]) -> None:
        """Remove every object of these custom resources (finalizers stripped first), and wait
        until they are gone: a clean slate between tests sharing the server."""
        for plural in plurals:
            code, lst = self.request("GET", f"/apis/{group}/{version}/{plural}")
            if code == 404:
                continue
            for o in lst.get("items") or []:
                ns, name = o["metadata"]["namespace"], o["metadata"]["name"]
                p = f"/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}"
                if o["metadata"].get("finalizers"):
                    self.request("PATCH", p, {"metadata": {"finalizers": None}}, "application/merge-patch+json")
                self.request("DELETE", p)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = [p for p in plurals if (self.request("GET", f"/apis/{group}/{version}/{p}")[1] or {}).get("items")]
            if not left:
                return
            time.sleep(0.1)
        raise AssertionError(f"custom resources left after cleanup: {left}")


def load_crds(folder: Path) -> list[dict[str, Any]]:
    return [d for f in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


# --- the composite proxy --------------------------------------------------------------------------


class CompositeProxy:
    """An aiohttp reverse proxy: the custom-resource groups to the real server, the rest to kmock.

    Runs in the caller's event loop (:meth:`start` / :meth:`stop` are coroutines). Streams every
    response (watches included). ``/apis`` is kmock's group list (plain ``application/json``
    discovery, not the aggregated kind) with the real server's groups in place of its own.
    """

    def __init__(self, real: RealCrdServer, kmock_url: str) -> None:
        self.real = real
        self.kmock_url = kmock_url.rstrip("/")
        self.runner: Any = None
        self.session: Any = None
        self.port = 0
        #: ``(method, path, Warning header)`` of the real server's answers: with the default
        #: field validation (Warn) an unknown field is pruned and reported only there.
        self.warnings: list[tuple[str, str, str]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _target(self, path: str) -> tuple[str, bool]:
        parts = path.split("/")
        if len(parts) > 2 and parts[1] == "apis" and parts[2] in REAL_GROUPS:
            return self.real.url, True
        if path.startswith("/openapi/"):
            return self.real.url, True
        return self.kmock_url, False

    async def _get_json(self, base: str, path: str, real: bool) -> Any:
        headers = {"Accept": "application/json"}
        if real:
            headers["Authorization"] = f"Bearer {TOKEN}"
        async with self.session.get(base + path, headers=headers, ssl=False if real else None) as r:
            return await r.json(content_type=None) if r.status == 200 else None

    async def _discovery(self, request: Any) -> Any:
        import aiohttp.web

        mine = await self._get_json(self.kmock_url, "/apis", False) or {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [],
        }
        groups = [g for g in mine.get("groups") or [] if g.get("name") not in REAL_GROUPS]
        for name in REAL_GROUPS:  # the apiextensions-apiserver has no /apis: ask per group
            g = await self._get_json(self.real.url, f"/apis/{name}", True)
            if g:
                groups.append({k: g[k] for k in ("name", "versions", "preferredVersion") if k in g})
        return aiohttp.web.json_response(dict(mine, kind="APIGroupList", apiVersion="v1", groups=groups))

    async def _handle(self, request: Any) -> Any:
        import aiohttp
        import aiohttp.web

        if request.path == "/apis" and request.method == "GET":
            return await self._discovery(request)
        base, real = self._target(request.path)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("accept", "content-type", "user-agent")}
        if "application/json;g=apidiscovery" in headers.get("Accept", ""):
            headers["Accept"] = "application/json"
        if real:
            headers["Authorization"] = f"Bearer {TOKEN}"
        data = await request.read()
        try:
            upstream = await self.session.request(
                request.method,
                base + request.path_qs,
                headers=headers,
                data=data or None,
                ssl=False if real else None,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=True,
            )
        except aiohttp.ClientError as e:
            return aiohttp.web.json_response(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "message": f"proxy: {e}",
                    "reason": "ServiceUnavailable",
                    "code": 503,
                },
                status=503,
            )
        async with upstream:
            resp = aiohttp.web.StreamResponse(status=upstream.status)
            ctype = upstream.headers.get("Content-Type")
            if ctype:
                resp.headers["Content-Type"] = ctype
            for w in upstream.headers.getall("Warning", []):
                resp.headers.add("Warning", w)
                if real:
                    self.warnings.append((request.method, request.path, w))
            await resp.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            except (ConnectionError, aiohttp.ClientError):
                pass
            return resp

    async def start(self) -> None:
        import aiohttp
        import aiohttp.web

        self.session = aiohttp.ClientSession(auto_decompress=True)
        app = aiohttp.web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = aiohttp.web.AppRunner(app, shutdown_timeout=0.5, handle_signals=False)
        await self.runner.setup()
        self.port = free_port()
        site = aiohttp.web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()
