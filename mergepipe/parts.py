"""Partitioned execution, commit of a run, and resume (``execute --part``, ``commit --run``,
``merge --workers``).

A plan splits into N parts along its output shards (:mod:`mergepipe.engine.partition`). Each
part is executed independently — by a process, a pod of an Indexed Job, or a retry of either —
with :func:`execute_part`, which writes only that part's shards (part 0 also the index and
config files) under the run's files prefix, a *file record* per finished file and a *part
record* at the end (:mod:`mergepipe.commit.runs`). :func:`commit_run` checks every part record
against the plan and the stored objects, composes the manifest (bytes summed over the parts)
and commits it exactly as a single-process merge does: conditional create of
``<out>/manifest.json`` on object storage, ``rename(2)`` of the run folder locally. The
snapshot is bit-identical to a single-process merge of the same plan: same shards, same
snapshot id, same manifest apart from the wall time, the start time and the ``parts`` entry.

Resume: a part re-executed in the same run keeps every file whose record is there and whose
bytes, read back, give the recorded size and digest, and merges only the rest; the reads of
kept files count under the role ``other``, never ``base`` or ``expert``. Runs are named after
the plan by default, so rerunning the same command after a crash resumes it.
:func:`execute_resumable` runs a whole plan this way (one part), for ``merge/execute --resume``.

Bytes across attempts. Every execution of a part is an *attempt* (a random id); each file
record carries its attempt's id and the bytes that attempt had moved when the file was durable.
A part record's ``realized`` is its final attempt's bytes (which read only what was missing),
and its ``earlier_attempts`` list, for each earlier attempt whose files were kept, the bytes it
had moved by its last recorded file: a lower bound of what it cost (what it read after that was
lost with it). The manifest's ``io.realized`` sums the final attempts, so realized <= planned
holds for every run, resumed or not; ``io.earlier_attempts`` sums the earlier ones (present only
after a resume): ``io.realized`` + ``io.earlier_attempts`` is what the snapshot cost in all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from mergepipe.commit import ownership, runs
from mergepipe.commit.target import CommitTarget, commit_target
from mergepipe.engine import executor
from mergepipe.engine.executor import ExecResult, default_compute_threads, needs_index
from mergepipe.engine.partition import PartSpec, partition
from mergepipe.errors import CommitConflict, MergepipeError
from mergepipe.formats.safetensors import INDEX_NAME
from mergepipe.planner.plan import Plan
from mergepipe.result import MergeResult, build_manifest, output_storage, realized_io, versions
from mergepipe.storage.base import Storage


def _target(plan: Plan, storage: Storage, out: str, target: CommitTarget | None) -> CommitTarget:
    """``target``, or the commit target of ``out`` (:func:`mergepipe.commit.target.commit_target`)
    written with :func:`mergepipe.result.output_storage`."""
    return target or commit_target(output_storage(plan, storage, out), out)


def _layout(plan: Plan, target: CommitTarget, run: str | None) -> runs.RunLayout:
    return target.run(run or runs.default_run_id(plan.digest))


def _side_files(plan: Plan, storage: Storage) -> tuple[set[str], set[str]]:
    """(required, optional) files of part 0 besides shards: the index when the plan needs
    one; the base's config/tokenizer files the plan lists."""
    return ({INDEX_NAME} if needs_index(plan) else set()), set(plan.extra_files)


def execute_part(
    plan: Plan,
    storage: Storage,
    out: str,
    part: PartSpec,
    *,
    run: str | None = None,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    prefetch_bytes: int | None = None,
    target: CommitTarget | None = None,
    resume: bool = True,
) -> dict | None:
    """Execute part ``part`` of ``plan`` into run ``run`` of snapshot ``out`` (not committed).

    Args:
        run: the run id (default :func:`mergepipe.commit.runs.default_run_id` of the plan).
        resume: keep the files an earlier attempt of this part finished (see the module
            docstring); with False every file of the part is rewritten.

    Returns:
        The part record written (see :mod:`mergepipe.commit.runs`), or None when ``out``
        already holds this plan's committed snapshot (nothing to do).

    Raises:
        InputError: ``out`` holds another plan's snapshot or is unusable; bad run id; inputs
            changed since planning; unusable device.
        CommitConflict: another process is executing the same part of this local run.
    """
    t_start, t0 = time.time(), time.perf_counter()
    target = _target(plan, storage, out, target)
    out_storage = target.storage
    layout = _layout(plan, target, run)
    if target.committed(plan.digest) is not None:
        return None
    rec = ownership.make_record(target.kind, out, layout.run, plan.digest)
    ownership.write_record(out_storage, layout.files, rec)
    with runs.part_lock(layout, part.index, part.count):
        return _execute_part(
            plan, storage, out_storage, layout, part, device, progress, prefetch_bytes, resume, t_start, t0
        )


def _execute_part(
    plan: Plan,
    storage: Storage,
    out_storage: Storage,
    layout: runs.RunLayout,
    part: PartSpec,
    device: str,
    progress: Callable[[int], None] | None,
    prefetch_bytes: int | None,
    resume: bool,
    t_start: float,
    t0: float,
) -> dict:
    shards = partition(plan, part.count)[part.index]
    required, optional = _side_files(plan, storage)
    side = (
        sorted(required | {f for f in optional if storage.exists(storage.join(plan.base.uri, f))})
        if part.writes_side_files
        else []
    )
    attempt = uuid.uuid4().hex[:16]
    kept = runs.kept_files(out_storage, layout, plan.digest, shards + side) if resume else {}
    side_done = all(f in kept for f in side)
    todo = [s for s in shards if s not in kept]
    rewrite = todo + ([] if side_done else side)
    for name in rewrite:
        out_storage.delete(runs.file_record_uri(out_storage, layout, name))
        if not out_storage.capabilities(layout.files).atomic_replace:  # a torn local file blocks its rewrite
            out_storage.delete(out_storage.join(layout.files, name))
    out_storage.make_prefix(layout.files)  # a local folder (never through a planted link); S3: nothing
    files = {n: r["info"] for n, r in kept.items() if n in shards or side_done}
    base_sha: dict[str, str] = {}
    for n, r in kept.items():
        if n in files:
            base_sha.update(r.get("base_tensor_sha256") or {})

    before = storage.counters.snapshot()

    def on_file(name: str, info: dict, base: dict[str, str]) -> None:
        spent = {"id": attempt, "realized": realized_io(before, storage.counters.snapshot())}
        runs.write_file_record(out_storage, layout, plan.digest, name, info, base, attempt=spent)

    if todo or not side_done:
        res = executor.execute(  # (looked up at call time: tests wrap it)
            plan,
            storage,
            out_storage,
            layout.files,
            device=device,
            progress=progress,
            prefetch_bytes=prefetch_bytes or plan.work_bytes,
            shards=todo,
            side_files=part.writes_side_files and not side_done,
            on_file=on_file,
        )
        files.update(res.files)
        base_sha.update(res.base_tensor_sha256)
    record = {
        "format": runs.PART_FORMAT,
        "plan_digest": plan.digest,
        "run": layout.run,
        "part": part.index,
        "parts": part.count,
        "shards": shards,
        "files": files,
        "kept": sorted(n for n in kept if n in files),
        "base_tensor_sha256": base_sha,
        "realized": realized_io(before, storage.counters.snapshot()),
        "attempt": attempt,
        "earlier_attempts": _earlier_attempts([kept[n] for n in kept if n in files]),
        "started_at": t_start,
        "wall_s": round(time.perf_counter() - t0, 3),
        "device": device,
        "versions": versions(),
    }
    runs.write_part_record(out_storage, layout, record)
    return record


def _earlier_attempts(kept_records: list[dict]) -> list[dict]:
    """The earlier attempts whose files were kept, each with the bytes it had moved by its last
    recorded file (the largest of its files' cumulative counts), sorted by attempt id."""
    best: dict[str, dict] = {}
    for rec in kept_records:
        a = rec.get("attempt") or {}
        if not isinstance(a, dict) or not isinstance(a.get("realized"), dict) or not a.get("id"):
            continue  # a record written before attempts were recorded
        r = a["realized"]
        moved = r.get("base_read_bytes", 0) + r.get("expert_read_bytes", 0) + r.get("output_write_bytes", 0)
        old = best.get(a["id"])
        if old is None or moved > old["_moved"]:
            best[a["id"]] = {"attempt": a["id"], "realized": dict(r), "_moved": moved}
    return [{k: v for k, v in best[i].items() if k != "_moved"} for i in sorted(best)]


def _part_counts(out_storage: Storage, layout: runs.RunLayout) -> list[int]:
    return sorted({n for _, n in runs.read_part_records(out_storage, layout)})


def commit_run(
    plan: Plan,
    storage: Storage,
    out: str,
    *,
    run: str | None = None,
    parts: int | None = None,
    target: CommitTarget | None = None,
    unsafe_single_writer: bool = False,
    lineage: dict | None = None,
) -> MergeResult:
    """Check a run's part records and commit its snapshot at ``out``.

    Args:
        run: the run id (default: the plan's).
        parts: N, the number of parts (default: the N of the run's part records, which must
            all agree).

    Raises:
        CommitConflict: a part record is missing or mismatched (the message names the part to
            re-run); another writer committed a different snapshot at ``out`` meanwhile.
        InputError: ``out`` holds another plan's snapshot or is unusable; the store ignores
            conditional writes (unless ``unsafe_single_writer``).
        RuntimeError: the parts' summed expert bytes exceed the plan (a bug; nothing committed).
    """
    target = _target(plan, storage, out, target)
    out_storage = target.storage
    layout = _layout(plan, target, run)
    done = target.committed(plan.digest)
    if done is not None:
        return MergeResult(out=str(out), manifest=done[0], manifest_hash=done[1], plan=plan, already_committed=True)
    if parts is None:
        counts = _part_counts(out_storage, layout)
        if not counts:
            raise CommitConflict(
                f"run {layout.run} of {out}: no part records; run `mergepipe execute PLAN --out {out} "
                f"--part I/N --run {layout.run}` for every part first."
            )
        if len(counts) > 1:
            raise CommitConflict(
                f"run {layout.run} of {out}: part records of {counts}-part splits; pass the N used (--parts N)."
            )
        parts = counts[0]
    target.prepare(unsafe_single_writer)
    return _publish(plan, storage, target, layout, parts, lineage)


def _publish(
    plan: Plan, storage: Storage, target: CommitTarget, layout: runs.RunLayout, parts: int, lineage: dict | None
) -> MergeResult:
    """Publish run ``layout`` of ``parts`` parts (its records checked, :func:`_run_manifest`),
    then remove its records and ownership record."""
    out_storage = target.storage
    manifest, mh, won = target.publish(
        layout, lambda: _run_manifest(plan, storage, out_storage, layout, parts, lineage)
    )
    out_storage.delete(layout.records.rstrip("/") + "/")
    ownership.remove_record(out_storage, layout.files)
    return MergeResult(out=target.out, manifest=manifest, manifest_hash=mh, plan=plan, already_committed=not won)


def _discard(target: CommitTarget, layout: runs.RunLayout) -> None:
    """Delete run ``layout`` (its files, records and ownership record); best effort."""
    st = target.storage
    for uri in (layout.files, layout.records):
        try:
            st.delete(uri.rstrip("/") + "/")
        except Exception:  # noqa: BLE001 - an undeletable run is debris gc reclaims by its record
            return
    ownership.remove_record(st, layout.files)


def _run_manifest(
    plan: Plan, storage: Storage, out_storage: Storage, layout: runs.RunLayout, parts: int, lineage: dict | None
) -> dict:
    """The manifest of a finished run: its part records checked (:func:`mergepipe.commit.runs.check_parts`)
    and their files and bytes summed.

    Raises:
        CommitConflict, RuntimeError: see :func:`commit_run`.
    """
    required, optional = _side_files(plan, storage)
    planned = {k: getattr(plan.io, k) for k in ("base_read_bytes", "expert_read_bytes", "output_write_bytes")}
    records = runs.check_parts(
        out_storage, layout, plan.digest, partition(plan, parts), required, optional, planned=planned
    )

    res = ExecResult()
    for rec in records:
        res.files.update(rec["files"])
        res.base_tensor_sha256.update(rec["base_tensor_sha256"])
    missing = {t.name for t in plan.tensors} - set(res.base_tensor_sha256)
    if missing:
        raise CommitConflict(f"run {layout.run}: no part recorded base tensor {sorted(missing)[0]!r}; re-run its part.")
    for tp in plan.tensors:
        for te in tp.experts:
            nm = plan.experts[te.expert].name
            res.touched_blocks[nm] = res.touched_blocks.get(nm, 0) + sum(b - a for a, b in te.blocks)
    res.wall_s = max(r["wall_s"] for r in records)
    realized = {k: sum(r["realized"].get(k, 0) for r in records) for k in records[0]["realized"]}
    earlier_list = [a["realized"] for r in records for a in r.get("earlier_attempts") or []]
    earlier = {k: sum(a.get(k, 0) for a in earlier_list) for k in realized} if earlier_list else None
    if realized["expert_read_bytes"] > plan.io.expert_read_bytes:
        raise RuntimeError(
            f"realized expert bytes {realized['expert_read_bytes']} exceed the planned "
            f"{plan.io.expert_read_bytes}: refusing to commit (a mergepipe bug; please report it)."
        )
    summary = [
        {
            "part": r["part"],
            "shards": len(r["shards"]),
            "files": sorted(r["files"]),
            "kept": r["kept"],
            "realized": r["realized"],
            **({"earlier_attempts": r["earlier_attempts"]} if r.get("earlier_attempts") else {}),
            "wall_s": r["wall_s"],
        }
        for r in records
    ]
    manifest = build_manifest(
        plan,
        res,
        None,
        None,
        min(r["started_at"] for r in records),
        records[0]["device"],
        files_prefix=layout.files_prefix,
        lineage=lineage,
        realized=realized,
        parts=summary,
        worker_versions=records[0].get("versions"),
    )
    if earlier is not None:
        manifest["io"]["earlier_attempts"] = earlier
    return manifest


def execute_single(
    plan: Plan,
    storage: Storage,
    out: str,
    *,
    target: CommitTarget | None = None,
    resume: bool = False,
    run: str | None = None,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    prefetch_bytes: int | None = None,
    unsafe_single_writer: bool = False,
    lineage: dict | None = None,
) -> MergeResult:
    """A single-process merge: the whole plan as the one part of a run (``--part 0/1``,
    :func:`execute_part`), committed in the same process (:func:`commit_run`'s checks and
    publish). What ``mergepipe merge/execute`` run without ``--workers``/``--part``.

    The run: on a target with exclusive runs (a local folder) the plan's run
    ``.<name>.run-plan-<digest[:16]>`` beside ``out``, executed and committed under ``out``'s
    lock (a second writer is refused at once, naming the holder); on object storage the plan's
    run ``runs/plan-<digest[:16]>`` with ``resume``, else a fresh run ``runs/<16 hex>`` (writers
    of one prefix share no lock; a loser's run is deleted by the conditional commit). Every
    finished file gets its record as in a partitioned run, so a rerun after a crash can keep it.

    ``resume``: keep every file an interrupted attempt of this plan's run finished (read back
    and checked against its recorded digest, see the module docstring) and merge only the rest.
    Without it every file is merged again, and a run that fails with an exception is removed
    (files, records, ownership record; a SIGKILLed one stays, owned, for a rerun or ``gc``).

    The snapshot does not depend on any of this: same shards, same snapshot id as any
    partitioned run of the plan; the manifest has a one-entry ``parts`` list and the run's
    ``files_prefix`` (``""`` for a folder).

    Raises:
        what :func:`execute_part` and :func:`commit_run` raise; CommitConflict when another
        live writer holds a local ``out``.
    """
    target = _target(plan, storage, out, target)
    inputs = [plan.base.uri, *(e.uri for e in plan.experts)]
    done = target.committed(plan.digest, inputs)
    if done is not None:
        return MergeResult(out=str(out), manifest=done[0], manifest_hash=done[1], plan=plan, already_committed=True)
    target.prepare(unsafe_single_writer)
    if run is None and not (resume or target.exclusive_runs):
        run = uuid.uuid4().hex[:16]  # a fresh run: nobody else writes it
    with target.exclusive():
        if target.exclusive_runs:  # committed by the writer we waited behind
            done = target.committed(plan.digest)
            if done is not None:
                return MergeResult(
                    out=str(out), manifest=done[0], manifest_hash=done[1], plan=plan, already_committed=True
                )
        layout = _layout(plan, target, run)
        t_start, t0 = time.time(), time.perf_counter()
        ownership.write_record(
            target.storage, layout.files, ownership.make_record(target.kind, out, layout.run, plan.digest)
        )
        with runs.part_lock(layout, 0, 1):  # (held: the run is ours to remove on failure)
            try:
                _execute_part(
                    plan,
                    storage,
                    target.storage,
                    layout,
                    PartSpec(0, 1),
                    device,
                    progress,
                    prefetch_bytes,
                    resume,
                    t_start,
                    t0,
                )
                return _publish(plan, storage, target, layout, 1, lineage)
            except BaseException:
                if not resume and (target.exclusive_runs or run != runs.default_run_id(plan.digest)):
                    _discard(target, layout)
                raise


def execute_resumable(
    plan: Plan,
    storage: Storage,
    out: str,
    *,
    run: str | None = None,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    prefetch_bytes: int | None = None,
    unsafe_single_writer: bool = False,
    lineage: dict | None = None,
) -> MergeResult:
    """:func:`execute_single` with ``resume``: what ``mergepipe merge/execute --resume`` run.

    Raises:
        what :func:`execute_single` raises.
    """
    return execute_single(
        plan,
        storage,
        out,
        resume=True,
        run=run,
        device=device,
        progress=progress,
        prefetch_bytes=prefetch_bytes,
        unsafe_single_writer=unsafe_single_writer,
        lineage=lineage,
    )


def run_workers(
    plan: Plan,
    storage: Storage,
    out: str,
    workers: int,
    *,
    run: str | None = None,
    device: str = "cpu",
    unsafe_single_writer: bool = False,
    lineage: dict | None = None,
) -> MergeResult:
    """Execute ``plan`` as ``workers`` parts in parallel processes (``mergepipe execute --part
    i/N``, the command an Indexed Job's pods run), then commit the run in this process.

    Each process gets ``max(1, default_compute_threads() // workers)`` torch threads (one core
    is left to I/O, as in one process; oversubscribed OpenMP threads slow a merge down). A rerun after a failure
    resumes (see the module docstring).

    Raises:
        MergepipeError: a part process failed (its last stderr lines are in the message; the
            run's finished files stay for a rerun).
        plus what :func:`commit_run` raises.
    """
    target = _target(plan, storage, out, None)
    done = target.committed(plan.digest)
    if done is not None:
        return MergeResult(out=str(out), manifest=done[0], manifest_hash=done[1], plan=plan, already_committed=True)
    target.prepare(unsafe_single_writer)
    layout = _layout(plan, target, run)
    env = dict(os.environ)
    env.setdefault("MERGEPIPE_COMPUTE_THREADS", str(max(1, default_compute_threads() // workers)))
    with tempfile.TemporaryDirectory(prefix="mergepipe-plan-") as tmp:
        plan_file = os.path.join(tmp, "plan.json")
        Path(plan_file).write_text(plan.to_json())
        procs = []
        for i in range(workers):
            cmd = [
                sys.executable,
                "-c",
                "from mergepipe.cli import main; main()",
                "execute",
                plan_file,
                "--out",
                str(out),
                "--part",
                f"{i}/{workers}",
                "--run",
                layout.run,
                "--device",
                device,
                "--json",
            ]
            errf = open(os.path.join(tmp, f"part-{i}.err"), "w+b")  # noqa: SIM115 - closed below
            procs.append((i, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errf, env=env), errf))
        failed = []
        for i, p, errf in procs:
            rc = p.wait()
            errf.seek(0)
            tail = errf.read().decode(errors="replace").strip().splitlines()[-5:]
            errf.close()
            if rc != 0:
                failed.append(f"part {i}/{workers} exited {rc}: " + " | ".join(tail))
        if failed:
            raise MergepipeError("; ".join(failed) + " (finished files are kept: rerun the same command to resume).")
    return commit_run(
        plan,
        storage,
        out,
        run=layout.run,
        parts=workers,
        target=target,
        unsafe_single_writer=unsafe_single_writer,
        lineage=lineage,
    )


def max_useful_parts(plan: Plan) -> int:
    """The number of output shards: more parts than this leave some parts empty."""
    return max(1, len({t.file for t in plan.tensors}))
