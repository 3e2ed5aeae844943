"""Fixtures of the operator tests; helpers live in op_testlib.py."""

import os
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


def apiserver_cost() -> str:
    """The cold build's cost as docs/figures.json gives it (one source for README, build.sh, CI)."""
    import json

    f = json.loads((Path(__file__).resolve().parents[2] / "docs" / "figures.json").read_text())
    return (
        f"downloads ~{f['apiserver_download']['value']} of Debian sid packages, "
        f"{f['apiserver_build']['value']} of build on 2 cores"
    )


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(scope="session")
def real_crd_server():
    """A real CRD API server (apiextensions-apiserver on etcd; realapi.py) with every CRD of
    crds/ installed, shared by the session. Skipped when its binaries were never built
    (tests/k8s_apiserver/build.sh), except in CI (CI=true), where that is a failure."""
    from realapi import ROOT, RealCrdServer, bin_dir, binaries_present, load_crds

    if not binaries_present():
        why = f"no real API server binaries in {bin_dir()}: run tests/k8s_apiserver/build.sh ({apiserver_cost()})"
        if in_ci():
            pytest.fail(why + " (CI=true: the real-API-server tests must run)")
        pytest.skip(why)
    with RealCrdServer() as server:
        for crd in load_crds(ROOT / "crds"):
            server.apply_crd(crd)
        yield server


def pytest_configure(config):
    config.addinivalue_line("markers", "fresh_catalog: the cluster fixture gives the operator an empty catalog prefix")
    config.addinivalue_line("markers", "apiserver: needs the real CRD API server (tests/k8s_apiserver/build.sh)")
