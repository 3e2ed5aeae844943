"""S3 storage: ``s3://bucket/key`` objects through boto3, with resumable ranged reads, parallel
multipart writes, server-side range copies and conditional creates.

Client setup
    One boto3 client per :class:`S3Storage`, credentials from the standard AWS chain (env
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, shared config files,
    web identity, container/instance roles). The endpoint is ``endpoint_url=`` or else
    ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` (honoured natively by botocore >= 1.28), else
    AWS. botocore ``Config``: ``max_pool_connections`` >= reader threads + writer parts in flight
    (botocore's default pool of 10 would serialize a 16-thread reader),
    ``request_checksum_calculation``/``response_checksum_validation="when_required"`` (boto3
    >= 1.36 otherwise sends and validates CRC32 on every call, which several S3-compatible servers
    mishandle: boto/boto3#4392; we send our own SHA-256 on writes instead), and ``standard``
    retries (exponential backoff with jitter for 5xx, throttling and connection errors before any
    response body is read).

AWS behaviour relied on (S3 API reference)
    * GetObject ``Range: bytes=a-b`` answers 206 with ``Content-Range: bytes a-b/size``; a range
      running past the end is truncated to the object; a start at/after the end is 416. S3 serves
      one range per GET (multi-range is not supported), hence one GET per coalesced request.
    * GetObject ``If-Match: <etag>`` answers 412 when the object changed; resumed reads use it so
      a retry never splices bytes of two versions.
    * PutObject / UploadPart ``x-amz-checksum-sha256``: S3 rejects a body whose digest differs
      (BadDigest), so corruption in transit cannot be stored.
    * PutObject ``If-None-Match: *`` (conditional writes, 2024-08): 412 PreconditionFailed when the
      key exists; 409 ConditionalRequestConflict when a concurrent conditional write is in flight
      (retry). Some S3-compatible stores ignore the header: see :meth:`S3Storage.probe_conditional_writes`.
    * Multipart upload: parts 1..10000, each 5 MiB..5 GiB except the last; UploadPartCopy with
      ``x-amz-copy-source-range`` copies a part server-side; parts of an upload that is neither
      completed nor aborted stay stored (and billed) invisibly, so every failure path aborts.
    * HEAD has no body: a 404 does not say whether the key or the bucket is missing (we ask
      HeadBucket), and S3 answers 403 instead of 404 for a missing key when the caller lacks
      ``s3:ListBucket``.

Credentials never appear in messages, logs or reprs: error messages are built from the URI, the
S3 error code, HTTP status and the server's message with any credential string redacted, and are
raised ``from None`` so botocore's exception (with the raw response) is not chained.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import http.client
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait as futures_wait

from mergepipe.storage.base import (
    DEFAULT_MAX_REQUEST,
    Capabilities,
    IOCounters,
    NotFoundError,
    ObjectStat,
    PreconditionFailed,
    Role,
    Storage,
    StorageError,
    Writer,
)

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * 1024
GiB = 1024 * MiB

#: S3's minimum size of every multipart part except the last (bytes)
MIN_PART = 5 * MiB
#: S3's maximum part size (bytes), also the largest UploadPartCopy range
MAX_PART = 5 * GiB
#: S3's maximum number of parts per multipart upload
MAX_PARTS = 10_000
#: largest safetensors header the reference loader accepts (bytes)
MAX_HEADER_BYTES = 100_000_000

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")

_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestLimitExceeded",
        "ProvisionedThroughputExceededException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "BandwidthLimitExceeded",
    }
)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "SignatureDoesNotMatch",
        "InvalidAccessKeyId",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidSecurity",
        "AllAccessDisabled",
        "AccountProblem",
        "403",
    }
)


class S3Error(StorageError):
    """A :class:`StorageError` from S3 carrying the S3 error ``code`` and HTTP ``status``
    (either may be ``None`` for network errors)."""

    def __init__(self, message: str, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class _ShortBody(Exception):
    """The response body ended before the bytes promised by Content-Range/Content-Length."""


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)``; the key may be empty (bucket root).

    Raises:
        StorageError: not an ``s3://`` URI or no bucket name.
    """
    s = str(uri)
    if not s.startswith("s3://"):
        raise StorageError(f"{s}: not an S3 URI; expected s3://bucket/key")
    rest = s[5:]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{s}: no bucket name; expected s3://bucket/key")
    return bucket, key


def _b64_sha256(data) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")


def _client_error_parts(exc) -> tuple[str, int | None, str]:
    resp = getattr(exc, "response", None) or {}
    err = resp.get("Error", {}) or {}
    code = str(err.get("Code", "") or "")
    status = (resp.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
    if not code and status:
        code = str(status)
    return code, status, str(err.get("Message", "") or "")


def _retry_attempts(exc) -> int:
    resp = getattr(exc, "response", None) or {}
    return int((resp.get("ResponseMetadata", {}) or {}).get("RetryAttempts", 0) or 0)


def _is_retryable(exc: BaseException) -> bool:
    """True for errors worth retrying: 5xx, throttling, connection/stream errors, short bodies."""
    from botocore.exceptions import (
        ClientError,
        ConnectionError as BotoConnectionError,
        HTTPClientError,
        IncompleteReadError,
    )

    if isinstance(exc, ClientError):
        code, status, _ = _client_error_parts(exc)
        return (status is not None and status >= 500) or code in _THROTTLE_CODES or status == 429
    urllib3_errors: tuple[type[BaseException], ...]
    try:
        from urllib3.exceptions import HTTPError as Urllib3HTTPError

        urllib3_errors = (Urllib3HTTPError,)
    except ImportError:  # pragma: no cover
        urllib3_errors = ()
    return isinstance(
        exc,
        (
            _ShortBody,
            IncompleteReadError,
            HTTPClientError,
            BotoConnectionError,
            http.client.HTTPException,
            ConnectionError,
            TimeoutError,
            *urllib3_errors,
        ),
    )


class S3Storage(Storage):
    """Objects in S3 (or an S3-compatible store) addressed as ``s3://bucket/key``.

    Args:
        counters: byte/request accounting shared with the caller.
        endpoint_url: S3 endpoint; default ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` or AWS.
        threads: size of the thread pool issuing ranged GETs, shared by all reads through this
            storage (default 16); the connection pool is sized to match.
        max_gap: ranges separated by at most this many bytes are fetched in one GET (default
            1 MiB; on S3 a request costs ~10-100 ms, i.e. about as much as 1 MiB of transfer).
        max_request: coalesced requests are split at this size in bytes (default 16 MiB, the top
            of the 8-16 MiB band AWS recommends for parallel ranged GETs).
        client: a ready boto3 S3 client (then ``endpoint_url`` and the retry settings are unused).
        unsafe_single_writer: the caller asserts that no other process writes the same output,
            so a store ignoring ``If-None-Match`` may still be committed to (checked by the commit
            step, stored here).
        part_size: multipart part size in bytes for :class:`S3Writer` (default 16 MiB; 5 MiB..5 GiB).
        copy_part_size: largest server-side copied part in bytes (default 256 MiB; >= 10 MiB).
        max_inflight_parts: parts one writer uploads concurrently; bounds writer memory to about
            ``(max_inflight_parts + 1) * part_size`` (default 4).
        max_attempts: botocore attempts per request, first try included (standard retry mode,
            passed as ``total_max_attempts``: botocore's ``max_attempts`` key counts retries only).
            Default 5.
        read_attempts: attempts per ranged GET in :meth:`_fetch`, each resuming at the first
            byte not yet received; botocore's own retries count towards it (default 8).
        backoff: base delay in seconds of our own exponential backoff (full jitter, default 0.2).
        connect_timeout, read_timeout: socket timeouts in seconds.

    Raises (from the methods): :class:`NotFoundError` for a missing key, :class:`S3Error`
    (a :class:`StorageError`) for everything else, with the URI and the fix in the message.
    """

    max_gap: int = 1 * MiB
    max_request: int = DEFAULT_MAX_REQUEST
    #: keys per ListObjectsV2 page (S3 maximum 1000)
    list_page_size: int = 1000

    def capabilities(self, uri: str) -> Capabilities:
        """No folders (publish by conditional manifest create), whole-object PUTs, server-side
        copy (UploadPartCopy)."""
        return Capabilities(folders=False, atomic_replace=True, server_side_copy=True)

    def __init__(
        self,
        counters: IOCounters | None = None,
        *,
        endpoint_url: str | None = None,
        threads: int = 16,
        max_gap: int = 1 * MiB,
        max_request: int = 16 * MiB,
        client=None,
        unsafe_single_writer: bool = False,
        part_size: int = 16 * MiB,
        copy_part_size: int = 256 * MiB,
        max_inflight_parts: int = 4,
        max_attempts: int = 5,
        read_attempts: int = 8,
        backoff: float = 0.2,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ) -> None:
        super().__init__(counters)
        if threads < 1:
            raise ValueError("threads must be >= 1")
        if max_gap < 0 or max_request < 1:
            raise ValueError("max_gap must be >= 0 and max_request >= 1")
        if not MIN_PART <= part_size <= MAX_PART:
            raise ValueError(f"part_size must be between {MIN_PART} and {MAX_PART} bytes")
        if not 2 * MIN_PART <= copy_part_size <= MAX_PART:
            raise ValueError(f"copy_part_size must be between {2 * MIN_PART} and {MAX_PART} bytes")
        if max_inflight_parts < 1 or read_attempts < 1 or max_attempts < 1:
            raise ValueError("max_inflight_parts, read_attempts and max_attempts must be >= 1")
        self.threads = threads
        self.max_gap = max_gap
        self.max_request = max_request
        self.unsafe_single_writer = unsafe_single_writer
        self.part_size = part_size
        self.copy_part_size = copy_part_size
        self.max_inflight_parts = max_inflight_parts
        self.read_attempts = read_attempts
        self.backoff = backoff
        self._endpoint_arg = endpoint_url
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if client is None:
            import boto3
            from botocore.config import Config

            cfg = Config(
                max_pool_connections=threads + 2 * max_inflight_parts + 2,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                retries={"mode": "standard", "total_max_attempts": max_attempts},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                tcp_keepalive=True,
            )
            try:
                client = boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=cfg)
            except Exception as e:  # botocore config errors (bad region, bad endpoint, ...)
                raise S3Error(f"cannot create the S3 client: {type(e).__name__}: {self._redact(str(e))}") from None
        self.client = client

    def __repr__(self) -> str:
        ep = getattr(getattr(self.client, "meta", None), "endpoint_url", None) or self._endpoint_arg
        if ep:
            ep = re.sub(r"//[^/@]*@", "//***@", str(ep))  # never show userinfo
        return f"S3Storage(endpoint_url={ep!r}, threads={self.threads}, max_gap={self.max_gap}, max_request={self.max_request})"

    # --- plumbing ----------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mergepipe-s3-read")
            return self._pool

    def close(self) -> None:
        """Shut down the reader thread pool (the client's connections close with it)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _credential_strings(self) -> list[str]:
        try:
            creds = self.client._request_signer._credentials  # noqa: SLF001 - for redaction only
            if creds is None:
                return []
            fc = creds.get_frozen_credentials()
            return [s for s in (fc.access_key, fc.secret_key, fc.token) if s]
        except Exception:  # noqa: BLE001
            return []

    def _redact(self, text: str) -> str:
        if not text or not hasattr(self, "client"):
            return text
        for s in self._credential_strings():
            if len(s) >= 4:
                text = text.replace(s, "***")
        return text

    def _sleep(self, attempt: int) -> None:
        """Full-jitter exponential backoff: uniform(0, backoff * 2**attempt), capped at 20 s."""
        time.sleep(random.uniform(0, min(20.0, self.backoff * (2**attempt))))

    def _error(self, exc: BaseException, uri: str, action: str) -> StorageError:
        """Translate a botocore/network exception into a StorageError naming ``uri``, the cause and
        the fix, without any credential material."""
        from botocore.exceptions import (
            ClientError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        if isinstance(exc, StorageError):
            return exc
        bucket = split_uri(uri)[0] if str(uri).startswith("s3://") else "?"
        if isinstance(exc, ClientError):
            code, status, msg = _client_error_parts(exc)
            msg = self._redact(msg)
            if code in ("NoSuchBucket",):
                return S3Error(
                    f"{uri}: bucket '{bucket}' does not exist ({action}); create the bucket "
                    "or fix the bucket name in the URI",
                    code,
                    status,
                )
            if code in ("NoSuchKey", "NotFound") or (status == 404 and code in ("404", "")):
                return NotFoundError(f"{uri}: no such object ({action}); check the URI or upload the object first")
            if code in ("PreconditionFailed",) or status == 412:
                return PreconditionFailed(
                    f"{uri}: precondition failed ({action}): the object already exists or changed"
                )
            if code in _DENIED_CODES or status == 403:
                return S3Error(
                    f"{uri}: access denied ({action}: {code or 'HTTP 403'}); check the credentials "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, the profile, or the mounted Secret), "
                    f"that they are allowed to access bucket '{bucket}', and the endpoint/region "
                    "(S3 also answers 403 for a missing key when s3:ListBucket is not granted)",
                    code,
                    status,
                )
            if code == "InvalidRange" or status == 416:
                return S3Error(
                    f"{uri}: requested range not satisfiable ({action}); the object is "
                    "shorter than expected, it was truncated or replaced",
                    code,
                    status,
                )
            detail = f": {msg}" if msg else ""
            return S3Error(f"{uri}: {action} failed with {code or 'an error'} (HTTP {status}){detail}", code, status)
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return S3Error(
                f"{uri}: no usable AWS credentials found ({action}); set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or mount the "
                "credentials Secret)",
                "NoCredentials",
                None,
            )
        if isinstance(exc, EndpointConnectionError):
            return S3Error(
                f"{uri}: cannot connect to the S3 endpoint ({action}); check "
                "AWS_ENDPOINT_URL / endpoint_url and the network",
                "EndpointConnection",
                None,
            )
        return S3Error(f"{uri}: {action} failed: {type(exc).__name__}: {self._redact(str(exc))}")

    def _bucket_missing(self, bucket: str) -> bool:
        """True iff HeadBucket says 404 (used to explain a bodiless HEAD 404)."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=bucket)
            return False
        except ClientError as e:
            _, status, _ = _client_error_parts(e)
            return status == 404
        except Exception:  # noqa: BLE001
            return False

    # --- reads --------------------------------------------------------------------------
    def stat(self, uri: str) -> ObjectStat:
        """HEAD ``uri``: size in bytes and ETag (quoted, as returned) as the version.

        Raises:
            NotFoundError: no such key.
            S3Error: the bucket does not exist, access denied (403), or another failure.
        """
        from botocore.exceptions import ClientError

        bucket, key = split_uri(uri)
        if not key:
            raise S3Error(f"{uri}: names a bucket, not an object; expected s3://bucket/key")
        try:
            r = self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            _, status, _ = _client_error_parts(e)
            if status == 404 and self._bucket_missing(bucket):
                raise S3Error(
                    f"{uri}: bucket '{bucket}' does not exist; create the bucket or fix the bucket name in the URI",
                    "NoSuchBucket",
                    404,
                ) from None
            raise self._error(e, uri, "HeadObject") from None
        except Exception as e:  # noqa: BLE001
            raise self._error(e, uri, "HeadObject") from None
        return ObjectStat(size=int(r["ContentLength"]), version=str(r.get("ETag", "")))

    def _get_range(
        self, uri: str, start: int, end: int, *, etag: str | None = None, allow_short: bool = False
    ) -> tuple[bytearray, int | None, str | None]:
        """GET bytes ``[start, end)`` of ``uri`` with resume-on-failure.

        Each attempt asks for ``bytes=<first missing byte>-<end-1>``; bytes that arrived before a
        connection broke are kept (never downloaded twice). Every attempt after the first answer
        carries ``If-Match`` with that answer's ETag (or ``etag`` from the start, when given), so
        bytes of two object versions are never mixed. Retries with jittered exponential backoff on
        5xx, throttling, connection resets, read timeouts, IncompleteRead and short bodies; the
        budget is ``read_attempts`` HTTP attempts per range, including the ones botocore already
        retried internally. The response must be 206 with a matching Content-Range (or 200 carrying
        exactly the requested bytes from offset 0, as some S3-compatible stores answer).

        With ``allow_short`` a range past the end of the object is truncated to the object
        (S3 semantics, used by the speculative header read).

        Returns:
            ``(buffer, object size in bytes or None, etag)``.

        Raises:
            NotFoundError, S3Error: not retryable, or still failing after ``read_attempts``.
        """
        bucket, key = split_uri(uri)
        buf = bytearray(end - start)
        mv = memoryview(buf)
        pos = 0  # bytes received so far
        stop = end  # one past the last byte wanted (smaller when allow_short truncates)
        total: int | None = None
        failures = 0
        while True:
            body = None
            first = start + pos
            try:
                kw = {"Bucket": bucket, "Key": key, "Range": f"bytes={first}-{stop - 1}"}
                if etag:
                    kw["IfMatch"] = etag
                resp = self.client.get_object(**kw)
                body = resp["Body"]
                stop, total = _checked_range_answer(uri, resp, start, end, first, stop, total, allow_short)
                etag = etag or resp.get("ETag")
                want = stop - start
                while pos < want:
                    n = body.readinto(mv[pos:want])
                    if not n:
                        raise _ShortBody(f"body ended at byte {start + pos} of [{start}, {stop})")
                    pos += n
                return (buf if stop == end else buf[: stop - start]), total, etag
            except Exception as e:  # noqa: BLE001 - classified below
                failures = self._range_failure(e, uri, start, end, failures, pos)
            finally:
                if body is not None:
                    try:
                        body.close()
                    except Exception:  # noqa: BLE001
                        pass

    def _range_failure(self, e: Exception, uri: str, start: int, end: int, failures: int, pos: int) -> int:
        """Classify a failed attempt of :meth:`_get_range` (``pos`` bytes received so far):
        raise when it is not retryable or the ``read_attempts`` budget is spent, else log, back
        off and return the new failure count (botocore's internal retries included).

        Raises:
            NotFoundError, S3Error: as :meth:`_get_range`.
        """
        if isinstance(e, StorageError) or not _is_retryable(e):
            err = self._error(e, uri, f"GetObject bytes [{start}, {end})")
            if isinstance(err, PreconditionFailed):
                err = S3Error(
                    f"{uri}: object changed while reading bytes [{start}, {end}) "
                    "(its ETag no longer matches); retry the operation",
                    "PreconditionFailed",
                    412,
                )
            raise err from None
        failures += 1 + _retry_attempts(e)
        if failures >= self.read_attempts:
            code, status = _client_error_parts(e)[:2] if hasattr(e, "response") else (None, None)
            raise S3Error(
                f"{uri}: GetObject bytes [{start}, {end}) failed after {failures} "
                f"attempts (last error: {self._redact(_describe(e))}; {pos} bytes "
                "received); the store is unavailable or overloaded, retry later",
                code,
                status,
            ) from None
        log.debug(
            "%s bytes [%d, %d): attempt %d failed (%s), resuming at byte %d",
            uri,
            start,
            end,
            failures,
            _describe(e),
            start + pos,
        )
        self._sleep(failures - 1)
        return failures

    def _fetch(self, uri: str, requests: Sequence[tuple[int, int]]) -> list[bytearray]:
        """Fetch coalesced ``requests`` (``[start, end)`` byte ranges) as one ranged GET each,
        concurrently on up to ``threads`` threads; returns one buffer per request, in order.
        No accounting (the caller counts). All requests must see the same ETag.

        Raises:
            NotFoundError, S3Error.
        """
        if not requests:
            return []
        if len(requests) == 1:
            s, e = requests[0]
            return [self._get_range(uri, s, e)[0]]
        pool = self._executor()
        futs = [pool.submit(self._get_range, uri, s, e) for s, e in requests]
        done, not_done = futures_wait(futs, return_when=FIRST_EXCEPTION)
        failed = [f for f in futs if f in done and f.exception() is not None]
        if failed:
            for f in not_done:
                f.cancel()
            futures_wait(not_done)
            exc = failed[0].exception()
            assert exc is not None
            raise exc
        results = [f.result() for f in futs]
        etags = {r[2] for r in results if r[2]}
        if len(etags) > 1:
            raise S3Error(f"{uri}: object changed while reading ({len(etags)} different ETags); retry the operation")
        return [r[0] for r in results]

    def read_header(self, uri: str, role: Role, speculative: int = 64 * KiB) -> bytes:
        """The raw safetensors header of ``uri``: the 8-byte little-endian length ``N`` plus the
        ``N`` header bytes (``8 + N`` bytes in all).

        One ranged GET of the first ``speculative`` bytes (no HEAD needed: a range past the end of
        a small object is truncated by S3), plus one more GET for the rest only when the header is
        larger. Bytes and requests are counted under ``role``.

        Raises:
            NotFoundError: no such object.
            S3Error: object shorter than 8 bytes, header length over 100 MB or past the end of
                the object, or any S3 failure.
        """
        try:
            first, total, etag = self._get_range(uri, 0, max(8, speculative), allow_short=True)
        except S3Error as e:
            if e.code == "InvalidRange":
                raise S3Error(
                    f"{uri}: object is empty, not a safetensors file (no 8-byte header "
                    "length); re-export or re-upload it",
                    e.code,
                    e.status,
                ) from None
            raise
        self.counters.add_read(role, len(first), 1)
        if len(first) < 8:
            raise S3Error(
                f"{uri}: object is {len(first)} bytes, shorter than the 8-byte safetensors "
                "header length; it is truncated or not a safetensors file"
            )
        n = int.from_bytes(first[:8], "little")
        if n > MAX_HEADER_BYTES:
            raise S3Error(
                f"{uri}: safetensors header length {n} bytes exceeds the 100 MB limit; the "
                "object is corrupt or not a safetensors file"
            )
        if total is not None and 8 + n > total:
            raise S3Error(
                f"{uri}: safetensors header length {n} bytes runs past the end of the "
                f"object ({total} bytes); it is truncated or not a safetensors file"
            )
        if 8 + n <= len(first):
            return bytes(first[: 8 + n])
        rest, _, _ = self._get_range(uri, len(first), 8 + n, etag=etag)
        self.counters.add_read(role, len(rest), 1)
        return bytes(first) + bytes(rest)

    def list(self, prefix: str) -> Iterator[str]:
        """``s3://bucket/key`` URIs of all objects under the folder ``prefix`` (a ``/`` is
        appended unless ``prefix`` is the bucket root or already ends in ``/``), recursively,
        sorted. ListObjectsV2, paginated (``list_page_size`` keys per request).

        Raises:
            S3Error: missing bucket, access denied, other failures.
        """
        bucket, key = split_uri(prefix)
        if key and not key.endswith("/"):
            key += "/"
        keys = self._list_keys(prefix, bucket, key)
        yield from (f"s3://{bucket}/{k}" for k in sorted(keys))

    def _list_keys(self, uri: str, bucket: str, key_prefix: str) -> builtins.list[str]:  # list: the method above
        keys: builtins.list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=key_prefix, PaginationConfig={"PageSize": self.list_page_size}
            )
            for page in pages:
                keys.extend(o["Key"] for o in page.get("Contents", ()) or ())
        except Exception as e:  # noqa: BLE001
            raise self._error(e, uri, "ListObjectsV2") from None
        return keys

    # --- writes -------------------------------------------------------------------------
    def put_object(
        self, uri: str, data: bytes, role: Role = "output", *, if_none_match: bool = False, durable: bool = False
    ) -> None:
        """PutObject ``data`` (whole object) with its SHA-256 (``x-amz-checksum-sha256``; the
        server rejects a corrupted body). ``len(data)`` bytes are counted as written under ``role``.
        ``durable`` is ignored: S3 stores an object durably before it acknowledges the PUT.

        With ``if_none_match`` the write is a conditional create (``If-None-Match: *``): 412 raises
        :class:`PreconditionFailed`; 409 ConditionalRequestConflict (a concurrent conditional write
        in flight) is retried with backoff. If botocore had to resend the request (the first answer
        was lost) and the 412 is caused by our own earlier attempt (stored SHA-256 equals ours),
        the write counts as successful.

        Raises:
            PreconditionFailed: ``if_none_match`` and the key exists.
            S3Error: missing bucket, access denied, other failures.
        """
        from botocore.exceptions import ClientError

        bucket, key = split_uri(uri)
        if not key:
            raise S3Error(f"{uri}: names a bucket, not an object; expected s3://bucket/key")
        body = bytes(data)
        sha = _b64_sha256(body)
        kw = {"Bucket": bucket, "Key": key, "Body": body, "ChecksumAlgorithm": "SHA256", "ChecksumSHA256": sha}
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        conflicts = 0
        while True:
            try:
                self.client.put_object(**kw)
                break
            except ClientError as e:
                code, status, _ = _client_error_parts(e)
                if if_none_match and (code == "ConditionalRequestConflict" or status == 409):
                    conflicts += 1
                    if conflicts < self.read_attempts:
                        self._sleep(conflicts - 1)
                        continue
                    raise S3Error(
                        f"{uri}: conditional create kept conflicting with concurrent writes "
                        f"({conflicts} attempts, 409 ConditionalRequestConflict); retry later",
                        code,
                        status,
                    ) from None
                if if_none_match and (code == "PreconditionFailed" or status == 412):
                    if _retry_attempts(e) > 0 and self._stored_sha256(bucket, key) == sha:
                        log.debug("%s: 412 after a resend, but the stored object is ours", uri)
                        break
                    raise PreconditionFailed(
                        f"{uri}: already exists; the conditional create (If-None-Match: *) lost to another writer"
                    ) from None
                raise self._error(e, uri, "PutObject") from None
            except Exception as e:  # noqa: BLE001
                raise self._error(e, uri, "PutObject") from None
        self.counters.add_write(role, len(body))

    def _stored_sha256(self, bucket: str, key: str) -> str | None:
        try:
            r = self.client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
            return r.get("ChecksumSHA256")
        except Exception:  # noqa: BLE001
            return None

    def open_writer(self, uri: str, role: Role = "output") -> S3Writer:
        """A multipart writer creating ``uri`` (see :class:`S3Writer`)."""
        bucket, key = split_uri(uri)
        if not key:
            raise S3Error(f"{uri}: names a bucket, not an object; expected s3://bucket/key")
        return S3Writer(self, uri, role)

    def delete(self, uri: str) -> None:
        """Delete one object, or every object under ``uri`` when it ends with ``/`` (or is the
        bucket root) using DeleteObjects in batches of 1000. Missing objects and a missing bucket
        are not errors.

        Raises:
            S3Error: access denied, or some keys could not be deleted.
        """
        from botocore.exceptions import ClientError

        bucket, key = split_uri(uri)
        try:
            if key and not key.endswith("/"):
                self.client.delete_object(Bucket=bucket, Key=key)
                return
            try:
                keys = self._list_keys(uri, bucket, key)
            except S3Error as e:
                if e.code == "NoSuchBucket":
                    return
                raise
            for i in range(0, len(keys), 1000):
                batch = keys[i : i + 1000]
                r = self.client.delete_objects(
                    Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
                errs = r.get("Errors") or []
                if errs:
                    e0 = errs[0]
                    raise S3Error(
                        f"{uri}: could not delete {len(errs)} object(s), e.g. "
                        f"s3://{bucket}/{e0.get('Key')}: {e0.get('Code')}; check permissions",
                        e0.get("Code"),
                        None,
                    )
        except ClientError as e:
            code, _, _ = _client_error_parts(e)
            if code == "NoSuchBucket":
                return
            raise self._error(e, uri, "DeleteObject") from None
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._error(e, uri, "DeleteObject") from None

    def probe_conditional_writes(self, prefix_uri: str) -> bool:
        """Does this store honour ``If-None-Match: *`` on PutObject?

        PUTs a fresh probe key ``<prefix_uri>/.mergepipe-probe-<uuid>`` twice with
        ``If-None-Match: *`` (different bodies); True iff the second PUT gets 412. Stores that
        reject the header as unsupported (400/501) count as False. The probe key is deleted
        afterwards (a few bytes, counted as written under ``other``).

        Raises:
            S3Error: the first PUT failed for another reason (missing bucket, access denied, ...).
        """
        uri = self.join(prefix_uri, f".mergepipe-probe-{uuid.uuid4().hex}")
        try:
            try:
                self.put_object(uri, b"mergepipe conditional-write probe 1\n", "other", if_none_match=True)
            except S3Error as e:
                if e.code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or e.status in (400, 501):
                    return False
                raise
            try:
                self.put_object(uri, b"mergepipe conditional-write probe 2\n", "other", if_none_match=True)
            except PreconditionFailed:
                return True
            except S3Error as e:
                if e.code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or e.status in (400, 501):
                    return False
                raise
            return False
        finally:
            try:
                self.delete(uri)
            except Exception as e:  # noqa: BLE001
                log.warning("could not delete conditional-write probe %s: %s", uri, e)


def _describe(e: BaseException) -> str:
    code, status, _ = _client_error_parts(e) if hasattr(e, "response") else ("", None, "")
    if code:
        return f"{code} (HTTP {status})"
    return type(e).__name__


class S3Writer(Writer):
    """Writes one object as an S3 multipart upload.

    * :meth:`write` buffers bytes into parts of ``storage.part_size`` bytes and uploads full parts
      in the background (at most ``max_inflight_parts`` at once: :meth:`write` blocks when that
      many are in flight, so memory stays about ``(max_inflight_parts + 1) * part_size``). Every
      part carries its SHA-256 (the upload is created with ``ChecksumAlgorithm=SHA256``, so S3
      stores a composite checksum). Uploaded bytes count as written under the writer's role when
      each part completes.
    * :meth:`copy_range` copies ranges of >= 5 MiB server-side with UploadPartCopy (counted as
      copied under the writer's role; split into parts of at most ``copy_part_size``). A copied
      part must start a new part, and every part but the last must be >= 5 MiB, so a pending
      buffer is first flushed as a part; if it is non-empty but < 5 MiB, the head of the copy
      range is read (role ``base``) to top it up to exactly 5 MiB, and the rest is copied
      server-side if still >= 5 MiB, else read too. Ranges < 5 MiB are read (``base``) and written.
    * Nothing is uploaded until the first full part: an object smaller than one part is written
      with a single PutObject at :meth:`close`.
    * :meth:`close` completes the upload and returns the size in bytes. Any failure in
      :meth:`write`, :meth:`copy_range` or :meth:`close` aborts the upload before the error
      propagates, so no multipart upload is left open; :meth:`abort` waits for in-flight parts
      (a part finishing after AbortMultipartUpload would stay stored) and never raises.
    """

    def __init__(self, storage: S3Storage, uri: str, role: Role) -> None:
        self.storage, self.uri, self.role = storage, uri, role
        self.bucket, self.key = split_uri(uri)
        self.part_size = storage.part_size
        self._client = storage.client
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: dict[int, dict] = {}
        self._parts_lock = threading.Lock()
        self._next_part = 1
        self._futures: list[Future] = []
        self._slots = threading.BoundedSemaphore(storage.max_inflight_parts)
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        self._state = "open"  # open | closed | aborted

    def __del__(self) -> None:
        if getattr(self, "_state", None) == "open" and getattr(self, "_upload_id", None) is not None:
            log.warning(
                "%s: S3Writer dropped without close() or abort(); its multipart upload stays "
                "open (and billed) until aborted or expired by a lifecycle rule",
                self.uri,
            )

    def __repr__(self) -> str:
        return f"S3Writer({self.uri!r}, role={self.role!r}, state={self._state!r}, size={self._size})"

    # --- internals ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state != "open":
            raise S3Error(f"{self.uri}: writer is {self._state}; open a new writer")

    def _ensure_upload(self) -> ThreadPoolExecutor:
        """Start the multipart upload and its part pool on first use; returns the pool."""
        if self._upload_id is not None:
            assert self._pool is not None  # created with the upload
            return self._pool
        try:
            r = self._client.create_multipart_upload(Bucket=self.bucket, Key=self.key, ChecksumAlgorithm="SHA256")
        except Exception as e:  # noqa: BLE001
            raise self.storage._error(e, self.uri, "CreateMultipartUpload") from None
        self._upload_id = r["UploadId"]
        self._pool = ThreadPoolExecutor(self.storage.max_inflight_parts, thread_name_prefix="mergepipe-s3-part")
        return self._pool

    def _take_part_number(self) -> int:
        self._ensure_upload()
        pn = self._next_part
        if pn > MAX_PARTS:
            raise S3Error(
                f"{self.uri}: more than {MAX_PARTS} multipart parts; the object is too large "
                f"for part_size={self.part_size} bytes, raise part_size"
            )
        self._next_part += 1
        return pn

    def _raise_if_failed(self) -> None:
        for f in self._futures:
            if f.done() and not f.cancelled():
                exc = f.exception()
                if exc is not None:
                    raise exc

    def _submit(self, fn, *args) -> None:
        pool = self._ensure_upload()
        self._raise_if_failed()
        self._slots.acquire()
        try:
            fut = pool.submit(self._run_slot, fn, *args)
        except BaseException:
            self._slots.release()
            raise
        self._futures.append(fut)

    def _run_slot(self, fn, *args):
        try:
            return fn(*args)
        finally:
            self._slots.release()

    def _upload_part(self, pn: int, data: bytearray) -> None:
        sha = _b64_sha256(data)
        try:
            r = self._client.upload_part(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self._upload_id,
                PartNumber=pn,
                Body=data,
                ChecksumAlgorithm="SHA256",
                ChecksumSHA256=sha,
            )
        except Exception as e:  # noqa: BLE001
            raise self.storage._error(e, self.uri, f"UploadPart {pn} ({len(data)} bytes)") from None
        with self._parts_lock:
            self._parts[pn] = {"PartNumber": pn, "ETag": r["ETag"], "ChecksumSHA256": r.get("ChecksumSHA256") or sha}
        self.storage.counters.add_write(self.role, len(data))

    def _copy_part(self, pn: int, src_uri: str, start: int, end: int) -> None:
        sb, sk = split_uri(src_uri)
        try:
            r = self._client.upload_part_copy(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self._upload_id,
                PartNumber=pn,
                CopySource={"Bucket": sb, "Key": sk},
                CopySourceRange=f"bytes={start}-{end - 1}",
            )
        except Exception as e:  # noqa: BLE001
            err = self.storage._error(e, src_uri, f"UploadPartCopy bytes [{start}, {end}) into {self.uri}")
            raise err from None
        res = r.get("CopyPartResult", {})
        part = {"PartNumber": pn, "ETag": res["ETag"]}
        if res.get("ChecksumSHA256"):
            part["ChecksumSHA256"] = res["ChecksumSHA256"]
        with self._parts_lock:
            self._parts[pn] = part
        self.storage.counters.add_copy(self.role, end - start)

    def _flush_part(self) -> None:
        if not self._buf:
            return
        data, self._buf = self._buf, bytearray()  # hand the buffer over: no copy
        self._submit(self._upload_part, self._take_part_number(), data)

    def _append(self, data) -> None:
        mv = memoryview(data).cast("B")
        n = len(mv)
        pos = 0
        while pos < n:
            take = min(n - pos, self.part_size - len(self._buf))
            self._buf += mv[pos : pos + take]
            pos += take
            if len(self._buf) >= self.part_size:
                self._flush_part()
        self._size += n

    # --- Writer API ------------------------------------------------------------------------
    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``; uploads full parts in the background. Raises :class:`S3Error` (the
        upload is aborted first)."""
        self._check_open()
        try:
            self._append(data)
        except BaseException as e:
            self.abort()
            if isinstance(e, Exception) and not isinstance(e, StorageError):
                raise self.storage._error(e, self.uri, "write") from None
            raise

    def copy_range(self, src_uri: str, start: int, end: int) -> None:
        """Append bytes ``[start, end)`` of ``src_uri`` (an ``s3://`` object on the same endpoint),
        server-side where S3's part rules allow it (see the class docstring).

        Raises:
            ValueError: invalid range. NotFoundError / S3Error: the source is missing or
            unreadable, or a copy failed (the upload is aborted first).
        """
        self._check_open()
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end})")
        if end == start:
            return
        try:
            split_uri(src_uri)
            read = self.storage.read_range
            n = end - start
            if n < MIN_PART:
                self._append(read(src_uri, start, end, "base"))
                return
            pending = len(self._buf)
            if 0 < pending < MIN_PART:
                need = MIN_PART - pending
                if n - need < MIN_PART:
                    self._append(read(src_uri, start, end, "base"))
                    return
                self._append(read(src_uri, start, start + need, "base"))
                start += need
                n -= need
            self._flush_part()  # pending is now 0 or a full/legal (>= 5 MiB) part
            k = -(-n // self.storage.copy_part_size)
            base, extra = divmod(n, k)
            pos = start
            for i in range(k):
                size = base + (1 if i < extra else 0)
                self._submit(self._copy_part, self._take_part_number(), src_uri, pos, pos + size)
                pos += size
            self._size += n
        except BaseException as e:
            self.abort()
            if isinstance(e, Exception) and not isinstance(e, StorageError):
                raise self.storage._error(e, self.uri, f"copy_range from {src_uri}") from None
            raise

    def close(self) -> int:
        """Complete the object and return its size in bytes. A second call returns the size again.

        Raises:
            S3Error: a part or the completion failed (the upload is aborted first).
        """
        if self._state == "closed":
            return self._size
        self._check_open()
        try:
            if self._upload_id is None:
                data = bytes(self._buf)
                self._buf = bytearray()
                self.storage.put_object(self.uri, data, self.role)
            else:
                self._flush_part()
                futures_wait(self._futures)
                self._raise_if_failed()
                parts = [self._parts[pn] for pn in sorted(self._parts)]
                if len(parts) != self._next_part - 1:
                    raise S3Error(f"{self.uri}: internal error: {len(parts)} parts finished of {self._next_part - 1}")
                if not all("ChecksumSHA256" in p for p in parts):
                    for p in parts:
                        p.pop("ChecksumSHA256", None)
                try:
                    self._client.complete_multipart_upload(
                        Bucket=self.bucket, Key=self.key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
                    )
                except Exception as e:  # noqa: BLE001
                    raise self.storage._error(e, self.uri, "CompleteMultipartUpload") from None
                if self._pool is not None:  # started with the first part
                    self._pool.shutdown(wait=True)
            self._state = "closed"
            return self._size
        except BaseException as e:
            self.abort()
            if isinstance(e, Exception) and not isinstance(e, StorageError):
                raise self.storage._error(e, self.uri, "close") from None
            raise

    def abort(self) -> None:
        """Discard everything: cancel queued parts, wait for in-flight ones, then
        AbortMultipartUpload. Never raises (failures are logged)."""
        if self._state in ("closed", "aborted"):
            return
        self._state = "aborted"
        self._buf = bytearray()
        try:
            for f in self._futures:
                f.cancel()
            futures_wait(self._futures)
            if self._upload_id is not None:
                for attempt in range(3):
                    try:
                        self._client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)
                        break
                    except Exception as e:  # noqa: BLE001
                        code, _, _ = _client_error_parts(e) if hasattr(e, "response") else ("", None, "")
                        if code == "NoSuchUpload":
                            break
                        if attempt == 2:
                            log.warning(
                                "%s: could not abort multipart upload: %s", self.uri, self.storage._redact(_describe(e))
                            )
                        else:
                            time.sleep(0.2 * (attempt + 1))
        except Exception as e:  # noqa: BLE001
            log.warning("%s: abort failed: %s", self.uri, type(e).__name__)
        finally:
            if self._pool is not None:
                try:
                    self._pool.shutdown(wait=False, cancel_futures=True)
                except Exception:  # noqa: BLE001
                    pass


def _checked_range_answer(
    uri: str, resp: dict, start: int, end: int, first: int, stop: int, total: int | None, allow_short: bool
) -> tuple[int, int | None]:
    """Check a GetObject answer to ``bytes=first-(stop-1)`` (of the range ``[start, end)``): 206
    with a matching Content-Range (truncated at the object's end only with ``allow_short``), or
    200 carrying exactly the requested bytes from offset 0. Returns the new ``(stop, total)``
    (``total``: the object's size when the answer tells it, else the one given).

    Raises:
        S3Error: an unparseable or mismatched Content-Range, an object shorter than the range,
            another status (the store does not honour Range requests).
    """
    status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    cr = resp.get("ContentRange")
    length = int(resp.get("ContentLength", -1))
    if status == 206 and cr:
        m = _CONTENT_RANGE.match(cr.strip())
        if not m:
            raise S3Error(f"{uri}: unparseable Content-Range {cr!r} for bytes [{first}, {stop})")
        a, b = int(m.group(1)), int(m.group(2))
        if m.group(3) != "*":
            total = int(m.group(3))
        past_end = total is not None and b == total - 1 and b < stop - 1
        if a == first and past_end and not allow_short:
            raise S3Error(
                f"{uri}: object is {total} bytes, shorter than the requested "
                f"bytes [{start}, {end}); it was truncated or replaced"
            )
        if a != first or (b != stop - 1 and not (allow_short and past_end)):
            raise S3Error(
                f"{uri}: server answered Content-Range {cr!r} to a request for "
                f"bytes [{first}, {stop}); the store does not honour ranges correctly"
            )
        return b + 1, total
    if status == 200 and first == 0 and length == stop:
        return stop, length  # whole object returned, and it is exactly the range
    raise S3Error(
        f"{uri}: expected 206 Partial Content for bytes [{first}, {stop}), got "
        f"HTTP {status} (Content-Range {cr!r}, {length} bytes); the store "
        "does not honour Range requests"
    )
