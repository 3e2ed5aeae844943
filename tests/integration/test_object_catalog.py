"""The object-storage catalog stores the same analyses as SQLite and plans identically; a planner
fed from index objects reads no checkpoint byte."""

from mergepipe.catalog.catalog import Catalog
from mergepipe.catalog.objectstore import ObjectCatalog, open_catalog
from mergepipe.pipeline import build_plan
from mergepipe.request import request_from_args
from mergepipe.storage.base import IOCounters
from mergepipe.storage.local import LocalStorage


def test_object_catalog_plans_like_sqlite_without_reading_checkpoints(family, tmp_path):
    base, experts = family
    ex = [(e.name, str(e)) for e in experts]
    req = request_from_args(str(base), ex, "ties", ["density=0.4"], budget="30%")
    sql = build_plan(Catalog(tmp_path / "c.sqlite"), LocalStorage(IOCounters()), req)
    cat = ObjectCatalog(LocalStorage(IOCounters()), str(tmp_path / "index"))
    st = LocalStorage(IOCounters())
    p1 = build_plan(cat, st, req)
    assert st.counters.snapshot()["read"]["expert"] > 0  # analyzed once
    # one plan digest, though each catalog keeps the sketch blobs elsewhere and in its own layout
    # (the digest holds which blob, the plan where it lies)
    sk1, sk0 = ([e.sketch["uri"] for e in p.experts if e.sketch] for p in (p1, sql))
    assert sk1 and len(sk1) == len(sk0) and not set(sk1) & set(sk0)
    assert p1.digest == sql.digest
    # a second planner (e.g. the operator) from the index objects: stats only, no checkpoint bytes
    cat2 = open_catalog("objects:" + str(tmp_path / "index"))
    st2 = LocalStorage(IOCounters())
    p2 = build_plan(cat2, st2, req)
    rd = st2.counters.snapshot()["read"]
    assert rd["expert"] == 0 and rd["base"] == 0
    assert p2.digest == p1.digest
    assert len(cat2.checkpoints()) == 1 + len(experts)
