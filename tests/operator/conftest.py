"""Fixtures of the operator tests; helpers live in op_testlib.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
from op_testlib import make_settings  # noqa: E402


@pytest.fixture
def settings():
    return make_settings()


@pytest.fixture(scope="session")
def s3_models(seaweed, family):
    """The tiny test family (bf16 base + 3 experts, 2 shards each) in a SeaweedFS bucket, and a
    catalog prefix where all three experts are analyzed (in-process, numpy only)."""
    from op_testlib import S3Models, analyze_into, upload_dir

    base, experts = family
    client = seaweed.client()
    bucket = seaweed.make_bucket("models")
    m = S3Models(
        bucket=bucket,
        base=upload_dir(client, bucket, base, "llama/base"),
        experts=[upload_dir(client, bucket, e, f"llama/{e.name}") for e in experts],
        catalog=f"s3://{bucket}/catalog-ready",
        client=client,
    )
    analyze_into(seaweed, m.catalog, m.base, m.experts)
    return m


def pytest_configure(config):
    config.addinivalue_line("markers", "fresh_catalog: the cluster fixture gives the operator an empty catalog prefix")
