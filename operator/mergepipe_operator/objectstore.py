"""The operator's object-storage calls: write a plan, read a manifest, HEAD the outputs.

A thin boto3 wrapper with the operator's own credentials (``AWS_*`` from its Secret) and the
endpoint/region from :class:`~mergepipe_operator.settings.Settings`. Kept separate from the core's
storage layer on purpose: the operator needs four calls and no torch/numpy.
"""

from __future__ import annotations

from typing import Any

from mergepipe.commit.manifest import MANIFEST_NAME  # "manifest.json" under the snapshot URI


def split_s3(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    return bucket, key


def join(prefix: str, name: str) -> str:
    return prefix.rstrip("/") + "/" + name.lstrip("/")


def manifest_uri(snapshot_uri: str) -> str:
    return join(snapshot_uri, MANIFEST_NAME)


class ObjectStore:
    def __init__(self, endpoint: str | None = None, region: str | None = None, client: Any = None):
        if client is None:
            import boto3

            client = boto3.session.Session().client("s3", endpoint_url=endpoint or None, region_name=region or None)
        self.s3 = client

    @staticmethod
    def _missing(e: Exception) -> bool:
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def get(self, uri: str) -> bytes | None:
        bucket, key = split_s3(uri)
        try:
            return self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as e:  # botocore ClientError
            if self._missing(e):
                return None
            raise

    def head_size(self, uri: str) -> int | None:
        bucket, key = split_s3(uri)
        try:
            return int(self.s3.head_object(Bucket=bucket, Key=key)["ContentLength"])
        except Exception as e:
            if self._missing(e):
                return None
            raise

    def put(self, uri: str, data: bytes, content_type: str = "application/json") -> None:
        bucket, key = split_s3(uri)
        self.s3.put_object(Bucket=bucket, Key=key, Body=data, ContentType=content_type)
