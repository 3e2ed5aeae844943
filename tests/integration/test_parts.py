"""Partitioned execution (``execute --part i/N`` + ``commit --run``, ``merge --workers``) and
resume: parts cover the plan exactly once; N parts give the single-process snapshot bit for
bit; the commit refuses missing or mismatched parts; a run killed part-way rereads only what
is missing."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from mergepipe.catalog.catalog import Catalog
from mergepipe.commit import runs
from mergepipe.commit.manifest import verify_snapshot
from mergepipe.engine.executor import execute
from mergepipe.engine.partition import PartSpec, parse_part, partition, partition_costs
from mergepipe.engine.worklist import build_work_list
from mergepipe.errors import CommitConflict, InputError
from mergepipe.parts import commit_run, execute_part, execute_resumable
from mergepipe.pipeline import build_plan, execute_and_commit
from mergepipe.planner.plan import InputRef, IOEstimate, Plan, TensorExpert, TensorPlan
from mergepipe.request import request_from_args
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from testkit.synth import llama_like_shapes, make_family

# ---- parts cover the plan exactly once ---------------------------------------------------------


@st.composite
def random_plans(draw):
    """Plans of random shape: shards with contiguous tensors of random shapes, chunk sizes,
    passes, copy/convert/merge and expert block selections."""
    n_shards = draw(st.integers(1, 7))
    tensors = []
    for s in range(n_shards):
        start = 0
        for t in range(draw(st.integers(1, 5))):
            shape = draw(st.sampled_from([[], [0, 4], [1], [7], [33, 5], [64, 16], [300, 3]]))
            rows = shape[0] if shape else 1
            dtype = draw(st.sampled_from(["BF16", "F32"]))
            rpb = draw(st.integers(1, 8))
            n_blocks = max(1, -(-rows // rpb))
            copy = draw(st.booleans())
            experts = []
            if not copy:
                for e in range(draw(st.integers(0, 3))):
                    b0 = draw(st.integers(0, n_blocks - 1))
                    b1 = draw(st.integers(b0 + 1, n_blocks))
                    experts.append(
                        TensorExpert(
                            expert=e,
                            file=f"s{s}.safetensors",
                            start=start,
                            blocks=[(b0, b1)],
                            bytes=100 * (b1 - b0),
                            kept_energy=0.0,
                            full_energy=0.0,
                        )
                    )
            tensors.append(
                TensorPlan(
                    name=f"s{s}.t{t}",
                    dtype=dtype,
                    shape=shape,
                    file=f"shard-{s}.safetensors",
                    start=start,
                    rows_per_block=rpb,
                    n_blocks=n_blocks,
                    chunk_rows=rpb * draw(st.integers(1, 4)),
                    passes=draw(st.sampled_from([1, 2])),
                    copy_base=copy,
                    experts=experts,
                    out_dtype=draw(st.sampled_from([None, None, "F16"])),
                )
            )
            start += 1000
    ref = InputRef(uri="/b", identity="x", signature={}, total_bytes=0)
    return Plan(
        method="ties",
        globals={},
        block_bytes=4096,
        work_bytes=1 << 20,
        base=ref,
        experts=[],
        tensors=tensors,
        io=IOEstimate(),
        expert_bytes_total=0,
        retained_energy=1.0,
    )


def _key(it):
    return (it.tp.name, it.kind, it.r0, it.r1, it.nbytes, it.opens_shard, it.ends_tensor, it.closes_shard)


@settings(max_examples=150, deadline=None)
@given(random_plans(), st.integers(1, 9), st.booleans())
def test_parts_cover_the_plan_exactly_once(plan, n, cow):
    parts = partition(plan, n)
    assert len(parts) == n
    shards = [s for p in parts for s in p]
    assert sorted(shards) == sorted({t.file for t in plan.tensors})  # every shard in exactly one part
    order = list(dict.fromkeys(t.file for t in plan.tensors))
    for p in parts:
        assert p == sorted(p, key=order.index)  # each part in output order
    whole = [_key(it) for it in build_work_list(plan, cow=cow)]
    split = [_key(it) for p in parts for it in build_work_list(plan, cow=cow, shards=p)]
    assert sorted(split) == sorted(whole) and len(split) == len(whole)  # same items, once each


@given(
    st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 10**6), min_size=1, max_size=30), st.integers(1, 12)
)
def test_lpt_partition_balance(costs, n):
    bins = partition_costs(costs, n)
    assert sorted(x for b in bins for x in b) == sorted(costs)
    loads = [sum(costs[x] for x in b) for b in bins]
    # Graham's bound for LPT: the largest part is at most 4/3 of the optimum (>= max(mean, max item))
    lower = max(sum(costs.values()) / n, max(costs.values()))
    assert max(loads) <= 4 / 3 * lower + 1e-9


@pytest.mark.parametrize("text", ["1/1", "-1/2", "2/2", "a/b", "1", "0/0", "0/100001"])
def test_bad_part_is_refused(text):
    with pytest.raises(InputError, match="--part"):
        parse_part(text)


# ---- N parts == 1 process, bit for bit -----------------------------------------------------------


@pytest.fixture(scope="module")
def fam4(tmp_path_factory):
    """bf16 base + 3 experts in 4 shards (a partition has something to balance)."""
    root = tmp_path_factory.mktemp("fam4")
    return make_family(root, 3, seed=3, n_shards=4, shapes=llama_like_shapes(64, 160, 4, 256))


def _plan(fam, tmp_path, budget="30%", method="dare_ties", params=("density=0.5", "rescale=true")):
    base, experts = fam
    st_ = open_storage(str(base), IOCounters())
    return build_plan(
        Catalog(tmp_path / "c.sqlite"),
        st_,
        request_from_args(
            str(base), [(e.name, str(e)) for e in experts], method, list(params), budget=budget, seed=4
        ).with_run(work_bytes=16 << 10),
    )


def _files(folder):
    return {p.name: p.read_bytes() for p in Path(folder).iterdir()}


def _same_but_parts(m1, m2):
    """The manifests agree on everything but time and the parts list."""
    strip = lambda m: {k: v for k, v in m.items() if k not in ("time", "parts")}  # noqa: E731
    assert strip(m1) == strip(m2)


@pytest.mark.parametrize("budget", [None, "30%"])
def test_n_parts_equal_one_process_locally(fam4, tmp_path, budget):
    plan = _plan(fam4, tmp_path, budget)
    base = str(fam4[0])
    one = execute_and_commit(plan, open_storage(base, IOCounters()), str(tmp_path / "one"))
    for n in (1, 2, 3, 5):
        out = str(tmp_path / f"p{n}")
        shards_written = []
        for i in reversed(range(n)):  # any order
            rec = execute_part(plan, open_storage(base, IOCounters()), out, PartSpec(i, n))
            shards_written += rec["shards"]
            assert not rec["kept"]
        res = commit_run(plan, open_storage(base, IOCounters()), out)
        assert res.manifest["snapshot_id"] == one.manifest["snapshot_id"]
        _same_but_parts(one.manifest, res.manifest)
        assert [p["part"] for p in res.manifest["parts"]] == list(range(n))
        got, want = _files(out), _files(one.out)
        assert set(got) == set(want)
        assert all(got[name] == want[name] for name in want if name != "manifest.json")
        assert verify_snapshot(out)["ok"]
        # nothing of the run is left beside the snapshot
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".p{n}.")) == []
        # rerunning a part or the commit of a committed plan does nothing
        assert execute_part(plan, open_storage(base, IOCounters()), out, PartSpec(0, n)) is None
        assert commit_run(plan, open_storage(base, IOCounters()), out).already_committed


def test_merge_with_workers_processes(fam4, tmp_path, monkeypatch, capsys):
    from testkit.harness import run_cli

    base, experts = fam4
    args = [
        "merge",
        "--base",
        str(base),
        *sum((["--expert", f"{e.name}={e}"] for e in experts), []),
        "--method",
        "ties",
        "--param",
        "density=0.5",
        "--budget",
        "40%",
        "--catalog",
        str(tmp_path / "c.sqlite"),
        "--json",
    ]
    rc, out1, err = run_cli([*args, "--out", str(tmp_path / "one")], monkeypatch, capsys)
    assert rc == 0, err
    rc, out2, err = run_cli([*args, "--out", str(tmp_path / "two"), "--workers", "2"], monkeypatch, capsys)
    assert rc == 0, err
    s1, s2 = json.loads(out1), json.loads(out2)
    assert s1["snapshot_id"] == s2["snapshot_id"] and s1["io"] == s2["io"]
    m = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert len(m["parts"]) == 2 and all(p["files"] for p in m["parts"])


# ---- the commit refuses missing or mismatched parts ----------------------------------------------


def test_commit_refuses_missing_and_mismatched_parts(fam4, tmp_path):
    plan = _plan(fam4, tmp_path)
    other = _plan(fam4, tmp_path, budget="60%")
    base = str(fam4[0])
    out = str(tmp_path / "snap")
    stg = open_storage(base, IOCounters())
    layout = runs.run_layout(stg, out, runs.default_run_id(plan.digest), False)

    with pytest.raises(CommitConflict, match="no part records"):
        commit_run(plan, stg, out)
    execute_part(plan, stg, out, PartSpec(0, 3))
    execute_part(plan, stg, out, PartSpec(2, 3))
    with pytest.raises(CommitConflict, match=r"part 1/3 has no record.*--part 1/3"):
        commit_run(plan, stg, out)
    rec1 = execute_part(plan, stg, out, PartSpec(1, 3))
    uri = runs.part_record_uri(stg, layout, 1, 3)
    good = Path(uri).read_bytes()

    # a record made for another plan
    bad = dict(rec1, plan_digest=other.digest)
    Path(uri).write_text(json.dumps(bad))
    with pytest.raises(CommitConflict, match="made for plan"):
        commit_run(plan, stg, out)
    # a record listing other shards than the partition gives
    bad = dict(rec1, shards=partition(plan, 3)[0])
    Path(uri).write_text(json.dumps(bad))
    with pytest.raises(CommitConflict, match="partition gives"):
        commit_run(plan, stg, out)
    Path(uri).write_bytes(good)
    # a listed file missing, or of another size
    shard = Path(layout.files) / rec1["shards"][0]
    data = shard.read_bytes()
    shard.unlink()
    with pytest.raises(CommitConflict, match="missing"):
        commit_run(plan, stg, out)
    shard.write_bytes(data[:-1])
    with pytest.raises(CommitConflict, match="size"):
        commit_run(plan, stg, out)
    # a record of another N
    shard.write_bytes(data)
    with pytest.raises(CommitConflict, match="no record"):
        commit_run(plan, stg, out, parts=2)
    assert not Path(out).exists()  # nothing was committed by any refusal
    res = commit_run(plan, stg, out)
    assert verify_snapshot(out)["ok"] and res.manifest["snapshot_id"]


# ---- resume after a kill -------------------------------------------------------------------------

KILL_SCRIPT = """
import os, signal, sys
from mergepipe.commit import runs
from mergepipe.engine.partition import PartSpec
from mergepipe.parts import execute_part
from mergepipe.planner.plan import Plan
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
plan_file, out, i, n, after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
plan = Plan.from_json(open(plan_file).read())
real, count = runs.write_file_record, [0]
def write_then_die(*a, **k):
    real(*a, **k)
    count[0] += 1
    if count[0] == after:
        os.kill(os.getpid(), signal.SIGKILL)
runs.write_file_record = write_then_die
execute_part(plan, open_storage(plan.base.uri, IOCounters()), out, PartSpec(i, n))
"""


def _per_shard_bytes(plan, tmp_path):
    """Base + expert bytes each shard alone reads (reads are per tensor chunk, so they add up)."""
    out = {}
    for f in dict.fromkeys(t.file for t in plan.tensors):
        st_ = open_storage(plan.base.uri, IOCounters())
        dst = tmp_path / "alone" / f
        dst.mkdir(parents=True)
        res = execute(plan, st_, st_, str(dst), shards=[f], side_files=False)
        out[f] = res.counters["read"]["base"] + res.counters["read"]["expert"]
    return out


@pytest.mark.parametrize("kill_after", [1, 2, 3])
def test_resume_after_kill_rereads_only_missing_files(fam4, tmp_path, kill_after):
    plan = _plan(fam4, tmp_path)
    base = str(fam4[0])
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    out = str(tmp_path / "snap")
    p = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(plan_file), out, "0", "1", str(kill_after)],
        capture_output=True,
        cwd=Path(__file__).parents[2],
    )
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    stg = open_storage(base, IOCounters())
    layout = runs.run_layout(stg, out, runs.default_run_id(plan.digest), False)
    recorded = sorted(Path(layout.records, "files").glob("*.json"))
    assert len(recorded) == kill_after

    rec = execute_part(plan, stg, out, PartSpec(0, 1))
    shards = partition(plan, 1)[0]
    kept = set(rec["kept"])
    assert kept == {p.name[: -len(".json")] for p in recorded}
    reread = rec["realized"]["base_read_bytes"] + rec["realized"]["expert_read_bytes"]
    alone = _per_shard_bytes(plan, tmp_path)
    side = sum(
        os.path.getsize(os.path.join(base, f)) for f in plan.extra_files if os.path.exists(os.path.join(base, f))
    )
    side_redone = not all(f in kept for f in ["model.safetensors.index.json", *plan.extra_files])
    assert reread == sum(alone[s] for s in shards if s not in kept) + (side if side_redone else 0)
    assert stg.counters.snapshot()["read"]["other"] > 0  # the kept files were read back and checked

    res = commit_run(plan, stg, out)
    one = execute_and_commit(plan, open_storage(base, IOCounters()), str(tmp_path / "one"))
    assert res.manifest["snapshot_id"] == one.manifest["snapshot_id"]
    assert res.manifest["parts"][0]["kept"] == sorted(kept)
    assert verify_snapshot(out)["ok"]


def test_resume_redoes_a_kept_file_whose_bytes_changed(fam4, tmp_path):
    plan = _plan(fam4, tmp_path)
    base = str(fam4[0])
    out = str(tmp_path / "snap")
    stg = open_storage(base, IOCounters())
    execute_part(plan, stg, out, PartSpec(0, 2))
    layout = runs.run_layout(stg, out, runs.default_run_id(plan.digest), False)
    victim = Path(layout.files) / partition(plan, 2)[0][0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1  # same size, other bytes
    victim.write_bytes(bytes(data))
    rec = execute_part(plan, stg, out, PartSpec(0, 2))
    assert victim.name not in rec["kept"] and "model.safetensors.index.json" in rec["kept"]
    execute_part(plan, stg, out, PartSpec(1, 2))
    res = commit_run(plan, stg, out)
    one = execute_and_commit(plan, open_storage(base, IOCounters()), str(tmp_path / "one"))
    assert res.manifest["snapshot_id"] == one.manifest["snapshot_id"]


def test_cli_execute_part_and_commit(fam4, tmp_path, monkeypatch, capsys):
    from testkit.harness import run_cli

    plan = _plan(fam4, tmp_path)
    pf = tmp_path / "plan.json"
    pf.write_text(plan.to_json())
    out = str(tmp_path / "snap")
    rc, _, err = run_cli(["execute", str(pf), "--out", out, "--part", "2/2"], monkeypatch, capsys)
    assert rc == 2 and "--part 2/2" in err
    rc, so, err = run_cli(["execute", str(pf), "--out", out, "--part", "0/2", "--json"], monkeypatch, capsys)
    assert rc == 0, err
    assert json.loads(so)["part"] == "0/2" and json.loads(so)["files"]
    rc, _, err = run_cli(["commit", str(pf), "--out", out], monkeypatch, capsys)
    assert rc == 2 and "part 1/2 has no record" in err and "--part 1/2" in err
    assert not Path(out).exists()
    rc, _, err = run_cli(["execute", str(pf), "--out", out, "--part", "1/2"], monkeypatch, capsys)
    assert rc == 0, err
    rc, so, err = run_cli(["commit", str(pf), "--out", out, "--json"], monkeypatch, capsys)
    assert rc == 0, err
    assert json.loads(so)["snapshot_id"] == json.loads((Path(out) / "manifest.json").read_text())["snapshot_id"]
    assert verify_snapshot(out)["ok"]


def test_a_part_running_elsewhere_is_not_executed_twice(fam4, tmp_path):
    import fcntl

    plan = _plan(fam4, tmp_path)
    out = str(tmp_path / "snap")
    stg = open_storage(str(fam4[0]), IOCounters())
    layout = runs.run_layout(stg, out, runs.default_run_id(plan.digest), False)
    Path(layout.records).mkdir(parents=True)
    # flock conflicts between open file descriptions, even of one process: this is "another process"
    fd = os.open(Path(layout.records) / "part-00000-of-00002.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(CommitConflict, match="part 0/2 is being executed by another process"):
            execute_part(plan, stg, out, PartSpec(0, 2))
        assert not Path(layout.files).exists()
        assert execute_part(plan, stg, out, PartSpec(1, 2))["files"]  # other parts are free
    finally:
        os.close(fd)
    assert execute_part(plan, stg, out, PartSpec(0, 2))["files"]  # lock released: it runs


# ---- plain merges resume (`execute/merge --resume`); bytes across attempts -------------------------

KILL_PRELUDE = """
import os, signal
from mergepipe.commit import runs
_real, _count = runs.write_file_record, [0]
def _write_then_die(*a, **k):
    _real(*a, **k)
    _count[0] += 1
    if _count[0] == {after}:
        os.kill(os.getpid(), signal.SIGKILL)
runs.write_file_record = _write_then_die
from mergepipe.cli import main
main()
"""


@pytest.mark.parametrize("kill_after", [1, 3, 5])
def test_plain_execute_resume_after_kill_at_several_points(fam4, tmp_path, monkeypatch, capsys, kill_after):
    """`execute PLAN --out DIR --resume` killed after its k-th durable file, then rerun: the rerun
    reads and writes only the missing files (byte counters), the snapshot is bit-identical to
    an uninterrupted single-process merge, and the manifest keeps what each attempt moved."""
    from testkit.harness import run_cli

    plan = _plan(fam4, tmp_path)
    base = str(fam4[0])
    pf = tmp_path / "plan.json"
    pf.write_text(plan.to_json())
    out = str(tmp_path / "snap")
    p = subprocess.run(
        [sys.executable, "-c", KILL_PRELUDE.format(after=kill_after), "execute", str(pf), "--out", out, "--resume"],
        capture_output=True,
        cwd=Path(__file__).parents[2],
    )
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    assert not Path(out).exists()  # nothing a reader could take for a snapshot
    layout = runs.run_layout(open_storage(base, IOCounters()), out, runs.default_run_id(plan.digest), False)
    recorded = {q.name[: -len(".json")] for q in Path(layout.records, "files").glob("*.json")}
    assert len(recorded) == kill_after

    rc, so, err = run_cli(["execute", str(pf), "--out", out, "--resume", "--json"], monkeypatch, capsys)
    assert rc == 0, err
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    (part,) = manifest["parts"]
    assert set(part["kept"]) == recorded
    alone = _per_shard_bytes(plan, tmp_path)
    shards = partition(plan, 1)[0]
    side_out = [f for f in manifest["outputs"] if f not in shards]  # index, config, tokenizer files
    side_redone = not all(f in recorded for f in side_out)  # side files are redone together
    side = sum(
        os.path.getsize(os.path.join(base, f)) for f in plan.extra_files if os.path.exists(os.path.join(base, f))
    )
    missing = [s for s in shards if s not in recorded]
    rz = manifest["io"]["realized"]
    assert rz["base_read_bytes"] + rz["expert_read_bytes"] == sum(alone[s] for s in missing) + (
        side if side_redone else 0
    )
    size = {f: o["size"] for f, o in manifest["outputs"].items()}
    written = sum(size[f] for f in missing) + (sum(size[f] for f in side_out) if side_redone else 0)
    assert rz["output_write_bytes"] == written  # only the missing files are written again
    # what the killed attempt moved by its last recorded file: counted apart, never in realized
    (earlier,) = part["earlier_attempts"]
    assert manifest["io"]["earlier_attempts"] == earlier["realized"]
    assert earlier["realized"]["output_write_bytes"] == sum(manifest["outputs"][f]["size"] for f in recorded)
    assert rz["expert_read_bytes"] <= plan.io.expert_read_bytes
    assert rz["expert_read_bytes"] + earlier["realized"]["expert_read_bytes"] >= plan.io.expert_read_bytes

    one = execute_and_commit(plan, open_storage(base, IOCounters()), str(tmp_path / "one"))
    assert manifest["snapshot_id"] == one.manifest["snapshot_id"] and manifest["outputs"] == one.manifest["outputs"]
    assert _files(out).keys() - {"manifest.json"} == _files(tmp_path / "one").keys() - {"manifest.json"}
    for f, data in _files(tmp_path / "one").items():
        if f != "manifest.json":
            assert _files(out)[f] == data, f
    assert verify_snapshot(out)["ok"]
    # an uninterrupted run records no earlier attempt
    assert "earlier_attempts" not in one.manifest["io"]


def test_gc_removes_abandoned_local_runs_only(fam4, tmp_path):
    """`gc` removes the `.<name>.run-plan-<hex>` folders a killed partitioned/resumable merge left,
    unless a part is executing (its lock is held) or they are younger than the grace period."""
    import fcntl

    from mergepipe.commit.gc import collect

    plan = _plan(fam4, tmp_path)
    base = str(fam4[0])
    out = str(tmp_path / "snaps" / "a")
    execute_part(plan, open_storage(base, IOCounters()), out, PartSpec(0, 2))  # part 1 never ran
    layout = runs.run_layout(open_storage(base, IOCounters()), out, runs.default_run_id(plan.digest), False)
    assert Path(layout.files).is_dir() and Path(layout.records).is_dir()
    st = open_storage(base, IOCounters())
    root = str(tmp_path / "snaps")
    rep = collect(st, root, grace_s=3600)
    assert rep.kept_young == [layout.files] and Path(layout.files).is_dir()
    lock = Path(layout.records) / "part-00001-of-00002.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # part 1 is being executed
    try:
        rep = collect(st, root, grace_s=0)
        assert rep.kept_in_use == [layout.files] and Path(layout.files).is_dir()
    finally:
        os.close(fd)
    rep = collect(st, root, grace_s=0, dry_run=True)
    assert rep.deleted_runs == [layout.files] and Path(layout.files).is_dir()
    rep = collect(st, root, grace_s=0)
    assert rep.deleted_runs == [layout.files]
    assert not Path(layout.files).exists() and not Path(layout.records).exists()
    # a committed snapshot beside it is untouched
    res = execute_resumable(plan, open_storage(base, IOCounters()), str(tmp_path / "snaps" / "b"))
    assert collect(st, root, grace_s=0).deleted_runs == [] and verify_snapshot(res.out)["ok"]
