"""Registration identity, analysis statistics, and caching (a cached analyze reads nothing)."""

import os
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mergepipe.catalog.catalog import Catalog
from mergepipe.errors import InputError
from mergepipe.numerics import magnitude_keys
from mergepipe.storage.base import IOCounters
from mergepipe.storage.local import LocalStorage
from testkit.synth import make_family, save_checkpoint


def _load(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def test_stats_match_direct_computation(family, tmp_path):
    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    e = cat.register(st, str(experts[0]))
    (a,) = cat.analyze(st, b, [e], block_bytes=4096)
    B, E = _load(base), _load(experts[0])
    for name, s in a.tensors.items():
        d = (E[name].float() - B[name].float()).flatten().numpy()
        assert s.numel == d.size
        assert s.sq_norm.sum() == pytest.approx(float((d.astype(np.float64) ** 2).sum()), rel=1e-9)
        assert s.l1.sum() == pytest.approx(float(np.abs(d).astype(np.float64).sum()), rel=1e-9)
        per = s.rows_per_block * (d.size // B[name].shape[0])
        for i in range(s.n_blocks):
            blk = d[i * per : (i + 1) * per]
            assert s.max_abs[i] == np.abs(blk).max()
            assert s.block_numel[i] == blk.size
        keys, counts = np.unique(magnitude_keys(d), return_counts=True)
        np.testing.assert_array_equal(s.hist_keys, keys)
        np.testing.assert_array_equal(s.hist_counts, counts)
        # octave histograms add up to the block energies
        np.testing.assert_allclose(s.oct_energy.sum(axis=1), s.sq_norm, rtol=1e-9)


def test_kept_energy_estimate_is_close(family, tmp_path):
    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    e = cat.register(st, str(experts[1]))
    (a,) = cat.analyze(st, b, [e], block_bytes=4096)
    B, E = _load(base), _load(experts[1])
    name = "model.layers.0.mlp.up_proj.weight"
    s = a.tensors[name]
    d = (E[name].float() - B[name].float()).flatten().numpy()
    for dens in (0.1, 0.5):
        mk = s.min_key(dens)
        exact = np.where(magnitude_keys(d) >= mk, d.astype(np.float64) ** 2, 0).sum()
        assert s.kept_energy(mk).sum() == pytest.approx(exact, rel=0.05)


def test_cached_analysis_reads_nothing_and_change_reanalyzes(tmp_path):
    base, experts = make_family(tmp_path / "m", 2, seed=5)
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    es = [cat.register(st, str(e)) for e in experts]
    cat.analyze(st, b, es)
    first = st.counters.snapshot()["read"]
    assert first["expert"] > 0 and first["base"] > 0

    st2 = LocalStorage(IOCounters())
    b2 = cat.register(st2, str(base))
    es2 = [cat.register(st2, str(e)) for e in experts]
    cat.analyze(st2, b2, es2)
    assert sum(st2.counters.snapshot()["read"].values()) == 0, "unchanged checkpoints must not be read again"
    assert b2.identity == b.identity

    # rewrite one expert in place (same shapes, same header) -> new identity, re-analyzed
    time.sleep(0.01)
    t = _load(experts[0])
    t = {k: (v.float() * 1.01).to(v.dtype) for k, v in t.items()}
    for f in experts[0].glob("*.safetensors"):
        f.unlink()
    save_checkpoint(experts[0], t, 2)
    st3 = LocalStorage(IOCounters())
    e3 = cat.register(st3, str(experts[0]))
    assert e3.identity != es[0].identity
    cat.analyze(st3, cat.register(st3, str(base)), [e3])
    assert st3.counters.snapshot()["read"]["expert"] > 0


def test_two_checkpoints_with_one_size_mtime_and_header_are_two_identities(tmp_path):
    """Two experts written by one script (same layout, so same sizes and header bytes) in one
    clock tick: size, mtime and header agree, the files and their contents do not. They must be
    two identities (the file's inode is part of the local version token), or the catalog would use
    one expert's statistics for the other and the merge would stop at the per-block content check."""
    base, experts = make_family(tmp_path / "m", 2, seed=5)
    t = _load(experts[0])
    twin = tmp_path / "m" / "twin"
    save_checkpoint(twin, {k: (v.float() * -1.0).to(v.dtype) for k, v in t.items()}, 2)
    pairs = []
    for f in sorted(experts[0].glob("*.safetensors")):
        g = twin / f.name
        assert g.stat().st_size == f.stat().st_size and g.read_bytes()[:64] == f.read_bytes()[:64]
        os.utime(g, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
        pairs.append((f, g))
    assert pairs and all(f.read_bytes() != g.read_bytes() for f, g in pairs)
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    a, b = cat.register(st, str(experts[0])), cat.register(st, str(twin))
    assert a.identity != b.identity
    base_rec = cat.register(st, str(base))
    sa, sb = cat.analyze(st, base_rec, [a, b])
    name = next(iter(sa.tensors))
    assert not np.array_equal(sa.tensors[name].l1, sb.tensors[name].l1)  # each its own statistics


def test_incompatible_expert_is_refused_before_reading(tmp_path):
    base, (e1,) = make_family(tmp_path / "m", 1, seed=6)
    t = _load(e1)
    bad = dict(t)
    bad["model.norm.weight"] = torch.zeros(7, dtype=torch.bfloat16)
    save_checkpoint(tmp_path / "shape", bad, 1)
    bad2 = dict(t)
    bad2["model.norm.weight"] = t["model.norm.weight"].float()
    save_checkpoint(tmp_path / "dtype", bad2, 1)
    bad3 = {k: v for k, v in t.items() if k != "lm_head.weight"}
    save_checkpoint(tmp_path / "missing", bad3, 1)
    cat = Catalog(tmp_path / "c.sqlite")
    for folder, msg in (("shape", "model.norm.weight"), ("dtype", "F32"), ("missing", "lm_head.weight")):
        st = LocalStorage(IOCounters())
        b = cat.register(st, str(base))
        e = cat.register(st, str(tmp_path / folder))
        with pytest.raises(InputError, match=msg):
            cat.analyze(st, b, [e])
        assert st.counters.snapshot()["read"]["expert"] == 0


def test_load_npz_equals_numpy_load_and_refuses_foreign_archives():
    """The catalog's fast ``.npz`` reader gives numpy.load's arrays for what ``to_bytes`` writes,
    reads other zip layouts through zipfile, and refuses what is not such an archive."""
    import io

    import numpy as np
    import pytest

    from mergepipe.catalog.stats import load_npz

    rng = np.random.default_rng(0)
    arrays = {
        "meta": np.array([5, 3, -7], dtype=np.int64),
        "sq_norm": rng.random(4),
        "max_abs": rng.random(4).astype(np.float32),
        "oct_count": rng.integers(0, 9, (4, 3)),
        "empty": np.zeros((0, 0)),
        "scalarish": np.array([1.5]),
    }
    for save in (np.savez, np.savez_compressed):
        buf = io.BytesIO()
        save(buf, **arrays)
        got = load_npz(buf.getvalue())
        ref = dict(np.load(io.BytesIO(buf.getvalue())))
        assert got.keys() == ref.keys()
        for k in ref:
            assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape
            assert np.array_equal(got[k], ref[k])
            got[k][...] = 0  # writable copies
    buf = io.BytesIO()
    np.savez(buf, x=np.array(["a"]))  # a dtype the catalog never writes
    with pytest.raises(ValueError, match="unexpected .npy header"):
        load_npz(buf.getvalue())
    with pytest.raises(ValueError, match="not a .npz archive"):
        load_npz(b"PK\x03\x04 not a zip")
    buf = io.BytesIO()
    np.savez(buf, x=np.arange(4))
    data = bytearray(buf.getvalue())
    at = data.index(b"\x93NUMPY")
    data[at + 10 + int.from_bytes(data[at + 8 : at + 10], "little") + 3] ^= 0xFF  # a flipped data byte
    with pytest.raises(ValueError, match="not a .npz archive"):  # (its CRC-32 no longer matches)
        load_npz(bytes(data))


def _reseal(header: bytes, body: bytes) -> bytes:
    """A packed statistics blob with this header and body and a correct digest (a forger's)."""
    import hashlib

    from mergepipe.catalog.stats import _PACK_HEAD, PACK_MAGIC

    header += b" " * (-(len(header) + _PACK_HEAD.size) % 8)
    rest = header + body
    return _PACK_HEAD.pack(PACK_MAGIC, hashlib.sha256(rest).digest(), len(header)) + rest


def test_packed_stats_keep_a_lora_experts_sketch_extent_without_planes(family, tmp_path):
    """A LoRA expert's statistics (analysed from its factors) carry a sketch extent but no coded
    planes: ``sketch_sq`` of shape ``(0, TIERS)``. The packed blob keeps that state (it was packed as
    if it had a row per block, and every LoRA merge failed on 'its header's counts say')."""
    import dataclasses

    from mergepipe.catalog.stats import TIERS, pack_stats, unpack_stats

    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    (a,) = cat.analyze(st, b, [cat.register(st, str(experts[0]))], block_bytes=4096)
    lora = {
        n: dataclasses.replace(s, sketch_start=max(s.sketch_start, 0), sketch_sq=np.zeros((0, TIERS)), sketch_sha=None)
        for n, s in a.tensors.items()
    }
    n0 = next(iter(a.tensors))
    mixed = {**a.tensors, n0: lora[n0]}  # one tensor without planes among sketched ones
    for stats in (lora, mixed):
        back = unpack_stats(pack_stats(stats))
        for n, s in stats.items():
            assert back[n].to_bytes() == s.to_bytes()
            assert back[n].sketch_start == s.sketch_start
            assert (back[n].sketch_sq is None) == (s.sketch_sq is None)
            if s.sketch_sq is not None:
                assert back[n].sketch_sq.shape == s.sketch_sq.shape


def test_both_stats_readers_build_alike_and_refuse_the_same_values(family, tmp_path):
    """``unpack_stats`` and ``TensorStats.from_bytes`` build through one constructor
    (``TensorStats.from_fields``): the same statistics come back from either stored form -- a
    sketched tensor, a LoRA expert's extent without planes, one without a sketch -- and a value
    that one refuses the other refuses with the same message (last session the packed reader
    drifted from the writer and every LoRA merge failed)."""
    import dataclasses

    from mergepipe.catalog.stats import _SECTIONS, ARRAY_FIELDS, TIERS, TensorStats, pack_stats, unpack_stats
    from mergepipe.numerics import N_KEYS

    assert [f for f, _, _ in _SECTIONS] != [] and {f for f, _, _ in _SECTIONS} == set(ARRAY_FIELDS)
    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    (a,) = cat.analyze(st, b, [cat.register(st, str(experts[0]))], block_bytes=4096)
    n0, s0 = next((n, s) for n, s in a.tensors.items() if s.has_sketch)
    kinds = {
        "sketched": s0,
        "lora extent": dataclasses.replace(s0, sketch_sq=np.zeros((0, TIERS)), sketch_sha=None),
        "no sketch": dataclasses.replace(s0, sketch_start=-1, sketch_sq=None, sketch_sha=None, block_sha=None),
    }
    for kind, s in kinds.items():
        packed = unpack_stats(pack_stats({n0: s}))[n0]
        npz = TensorStats.from_bytes(n0, s.to_bytes(), s.content_sha256)
        for got in (packed, npz):
            assert got.to_bytes() == s.to_bytes(), kind
            assert (got.sketch_start, got.has_sketch, got.content_sha256) == (
                s.sketch_start,
                s.has_sketch,
                s.content_sha256,
            ), kind
            assert (got.block_sha is None, got.sketch_sha is None) == (s.block_sha is None, s.sketch_sha is None)

    def bad(**kw):
        return dataclasses.replace(s0, **{k: v(getattr(s0, k).copy()) for k, v in kw.items()})

    def neg(a):
        a[0] = -1
        return a

    def key_out(a):
        a[-1] = N_KEYS
        return a

    def nan(a):
        a[0, 0] = np.nan
        return a

    for s, msg in [
        (bad(hist_counts=neg), "negative counts in 'hist_counts'"),
        (bad(oct_count=neg), "negative counts in 'oct_count'"),
        (bad(block_numel=neg), "negative counts in 'block_numel'"),
        (bad(hist_keys=key_out), "magnitude keys out of range"),
        (bad(sketch_sq=nan), "sketch residual energies not finite"),
    ]:
        with pytest.raises(ValueError, match=msg):
            unpack_stats(pack_stats({n0: s}))
        with pytest.raises(ValueError, match=msg):
            TensorStats.from_bytes(n0, s.to_bytes())
    # shapes: the packed form's sizes come from its header (refused as "counts say"); the
    # .npz form carries its own shapes, checked by the shared constructor
    with pytest.raises(ValueError, match="inconsistent shapes"):
        TensorStats.from_bytes(n0, dataclasses.replace(s0, l1=s0.l1[:-1]).to_bytes())
    with pytest.raises(ValueError, match="inconsistent shapes"):
        TensorStats.from_bytes(n0, dataclasses.replace(s0, sums=np.zeros(3)).to_bytes())


def test_packed_stats_round_trip_and_refuse_damage(family, tmp_path):
    """One blob per expert holds every tensor's statistics exactly; a flipped bit, another
    format, a truncation, and a re-digested blob whose sizes or values are wrong are refused."""
    import json

    from mergepipe.catalog.stats import _PACK_HEAD, pack_stats, unpack_stats

    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    (a,) = cat.analyze(st, b, [cat.register(st, str(experts[0]))], block_bytes=4096)
    blob = pack_stats(a.tensors)
    back = unpack_stats(blob)
    assert list(back) == list(a.tensors)
    for n, s in a.tensors.items():
        assert back[n].to_bytes() == s.to_bytes() and back[n].content_sha256 == s.content_sha256
    assert any(s.has_sketch for s in back.values()) and all(s.block_sha is not None for s in back.values())
    back[n].sq_norm[0] = 1.0  # writable
    hlen = _PACK_HEAD.unpack_from(blob)[2]
    header, body = blob[_PACK_HEAD.size : _PACK_HEAD.size + hlen], blob[_PACK_HEAD.size + hlen :]
    rows = json.loads(header)["tensors"]
    flipped = bytearray(blob)
    flipped[-5] ^= 0x01
    bigger = [list(r) for r in rows]
    bigger[0][6] += 1  # one more block than the body holds
    for data, msg in [
        (bytes(flipped), "digest mismatch"),
        (blob[:-8], "digest mismatch"),
        (blob[:20], "shorter than"),
        (b"PK\x03\x04" + blob[4:], "format tag"),
        (_reseal(header, body + b"\0" * 8), "header's counts say"),
        (_reseal(json.dumps({"tensors": bigger}).encode(), body), "header's counts say"),
        (_reseal(b'{"tensors": [[[[1]]]]}', body), "nested too deep"),
        (_reseal(b'{"tensors": [["x", "y", -1, 1, 0, -1, 1, 1, 0, 0, 0, 0]]}', body), "rows of the wrong form"),
        (_reseal(b"not json", body), "not the expected JSON"),
    ]:
        with pytest.raises(ValueError, match=msg):
            unpack_stats(data)
    # valid sizes, bad values: the first hist_counts entry negative (a forger re-digests)
    from mergepipe.catalog.stats import _SECTIONS

    counts = [tuple(r[6:12]) for r in rows]
    pos = 0
    for f, dt, size in _SECTIONS:
        if f == "hist_counts":
            break
        pos += sum(size(c) for c in counts) * np.dtype(dt).itemsize
    bad = bytearray(body)
    bad[pos : pos + 8] = np.int64(-1).tobytes()
    with pytest.raises(ValueError, match="negative counts"):
        unpack_stats(_reseal(header, bytes(bad)))


def test_catalog_of_an_older_version_is_analysed_again_and_says_so(family, tmp_path, capsys):
    """Statistics from an older mergepipe are recomputed once, with one line on stderr."""
    import mergepipe.catalog.catalog as catmod

    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    es = [cat.register(st, str(e)) for e in experts[:2]]
    cat.analyze(st, b, es, block_bytes=4096)
    assert capsys.readouterr().err == ""
    with cat.db:
        cat.db.execute("UPDATE analyses SET stats_version = ?", (catmod.STATS_VERSION - 1,))
    before = st.counters.snapshot()["read"]["expert"]
    cat.analyze(st, b, es, block_bytes=4096)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "of 2 of these experts in an older format" in err
    assert f"stats version {catmod.STATS_VERSION - 1}" in err and "analysing them again" in err
    assert st.counters.snapshot()["read"]["expert"] > before
    cat.analyze(st, b, es, block_bytes=4096)  # cached now: silent, nothing read
    assert capsys.readouterr().err == ""


def test_analysis_runs_blas_on_one_thread(family, tmp_path, monkeypatch):
    """numpy's BLAS pool is limited to one thread while the sketches' SVDs run (OpenBLAS's
    spinning threads made them 40-70x slower in wall on a loaded 2-core machine), and the
    caller's setting is restored afterwards."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from mergepipe.catalog import sketch

    def blas_threads() -> set[int]:
        return {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}

    seen: list[set[int]] = []
    real = sketch.rank1_factors

    def spy(d):
        seen.append(blas_threads())
        return real(d)

    monkeypatch.setattr(sketch, "rank1_factors", spy)
    base, experts = family
    cat = Catalog(tmp_path / "c.sqlite")
    st = LocalStorage(IOCounters())
    b = cat.register(st, str(base))
    e = cat.register(st, str(experts[2]))
    with threadpool_limits(limits=2, user_api="blas"):
        outer = blas_threads()
        if outer != {2}:
            pytest.skip(f"this numpy's BLAS cannot be set to 2 threads here ({outer})")
        (a,) = cat.analyze(st, b, [e], block_bytes=4096)
        after = blas_threads()
    assert a.sketch is not None and seen, "the analysis computed no sketch"
    assert all(s == {1} for s in seen), seen
    assert after == {2}
