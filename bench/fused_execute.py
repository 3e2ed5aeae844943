"""``mergepipe execute`` of saved plans end to end, the torch path against the fused CPU kernels,
alternating in one sitting.

Per round, per plan (``--plan LABEL=PLAN.json``, in the order given), ``mergepipe execute PLAN
--out WORK/LABEL-PATH --json`` runs twice, first with ``MERGEPIPE_KERNELS=torch`` (path
``torch``) then without (path ``c``: the fused kernels of :mod:`mergepipe.methods.kernels_cpu`),
each a fresh process into a fresh output folder, measured by :func:`bench.measure.run_measured`
(process wall from fork to exit, user + system CPU seconds, peak RSS as the process's own
``VmHWM``). The engine's ``wall_s`` is read from ``--json``; the output's digest is the SHA-256
over the bytes of every ``.safetensors`` file of the snapshot, in name order (the torch and the
fused path must write the same bytes: a difference stops the run, exit 1).

The result is the raw record ``bench/benchmarks_report.py`` renders into docs/BENCHMARKS.md
(``docs/benchmarks/fused-execute-*.txt``): ``#`` header lines (what ran, the commit, the time,
the machine, the command), then one line per run::

    10% torch load=4.96 wall=9.60 cpu=5.69 rss=342MiB engine_wall=6.66 out=f44f137c7fbf

Usage (plans from ``mergepipe plan ... --out PLAN.json``)::

    python bench/fused_execute.py --plan 10%=p10.json --plan unlimited=pfull.json --rounds 3 \\
        --work bench/.work/fused-exec --out docs/benchmarks/fused-execute-NAME.txt

Exit codes: 0 done, 1 a run failed or the two paths' outputs differ, 2 bad arguments (a plan
that is not a file, a label used twice, no C compiler for the fused kernels).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import measure, record  # noqa: E402

PATHS = ("torch", "c")


def output_digest(folder: Path) -> str:
    """SHA-256 (hex) over the bytes of every ``*.safetensors`` file under ``folder``, in sorted
    relative-path order.

    Raises:
        FileNotFoundError: ``folder`` holds no ``.safetensors`` file.
    """
    files = sorted(folder.rglob("*.safetensors"), key=lambda p: p.relative_to(folder).as_posix())
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors file in the output")
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


def line(label: str, path: str, load: float, m: dict, engine_wall_s: float, digest: str) -> str:
    """One run's line of the raw record (the format :func:`bench.benchmarks_report.read_fused_execute`
    parses): ``m`` is :func:`bench.measure.run_measured`'s result (seconds, KiB)."""
    cpu = m["utime_s"] + m["stime_s"]
    rss = round(m["peak_rss_kib"] / 1024)
    return (
        f"{label:>9} {path:>5} load={load:.2f} wall={m['wall_s']:.2f} cpu={cpu:.2f} rss={rss}MiB "
        f"engine_wall={engine_wall_s:.3f} out={digest[:12]}"
    )


def _parse_plans(specs: Sequence[str]) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for s in specs:
        label, sep, p = s.partition("=")
        if not sep or not label or any(c.isspace() for c in label):
            raise ValueError(f"--plan {s!r}: expected LABEL=PLAN.json (a label without spaces)")
        if label in {x for x, _ in out}:
            raise ValueError(f"--plan {s!r}: the label {label!r} is used twice")
        if not Path(p).is_file():
            raise ValueError(f"--plan {s!r}: {p} is not a file (write it with `mergepipe plan ... --out {p}`)")
        out.append((label, Path(p)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rounds and print (and with ``--out`` write) the raw record; see the module
    docstring for the exit codes."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", action="append", required=True, help="LABEL=PLAN.json (repeat; in run order)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, required=True, help="folder for the outputs (emptied per run)")
    ap.add_argument("--out", type=Path, default=None, help="write the raw record here [print only]")
    ap.add_argument("--note", default="", help="what the plans are (fixture, method, budgets), for the header")
    args = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(args)
    try:
        plans = _parse_plans(a.plan)
        if a.rounds < 1:
            raise ValueError(f"--rounds {a.rounds}: at least 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from mergepipe.methods import kernels_cpu

    if not kernels_cpu.available():
        print(f"error: fused CPU kernels unavailable: {kernels_cpu.unavailable_reason()}", file=sys.stderr)
        return 2
    prov = record.provenance("bench/fused_execute.py", args)
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    lines: list[str] = []
    digests: dict[str, set[str]] = {}
    a.work.mkdir(parents=True, exist_ok=True)
    for _ in range(a.rounds):
        for label, plan in plans:
            for path in PATHS:
                env = dict(os.environ)
                if path == "torch":
                    env["MERGEPIPE_KERNELS"] = "torch"
                else:
                    env.pop("MERGEPIPE_KERNELS", None)
                out = a.work / f"{label.replace('%', 'pct')}-{path}"
                shutil.rmtree(out, ignore_errors=True)
                load = os.getloadavg()[0]
                cmd = [sys.executable, "-m", "mergepipe.cli", "execute", str(plan), "--out", str(out), "--json"]
                m = measure.run_measured(
                    cmd, env=env, stdout_path=a.work / "stdout.json", stderr_path=a.work / "stderr.txt"
                )
                if m["rc"] != 0:
                    tail = (a.work / "stderr.txt").read_text().strip().splitlines()[-1:]
                    print(f"error: {label} {path}: execute exited {m['rc']}: {' '.join(tail)}", file=sys.stderr)
                    return 1
                engine = float(json.loads(m["stdout"])["wall_s"])
                digest = output_digest(out)
                lines.append(line(label, path, load, m, engine, digest))
                print(lines[-1], flush=True)
                digests.setdefault(label, set()).add(digest)
                if len(digests[label]) > 1:
                    print(f"error: {label}: the torch and fused outputs differ (a kernel bug)", file=sys.stderr)
                    return 1
    ended = dt.datetime.now(dt.timezone.utc).strftime("%H:%M")
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    header = [
        f"# mergepipe execute of saved plans ({', '.join(lb for lb, _ in plans)}{'; ' + a.note if a.note else ''}), "
        "alternating",
        f"# MERGEPIPE_KERNELS=torch (torch) and the fused CPU kernels (c), code at {prov['git'][:7]}, "
        f"{started}-{ended} UTC, {os.cpu_count()}-core/{mem_gib:.1f} GiB;",
        "# wall/cpu (user+sys s)/rss (peak VmHWM) from bench/measure.py; engine_wall = --json wall_s; "
        "out = SHA-256 (first 12) of the output shards",
        f"# command: {' '.join(prov['command'])}",
    ]
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("\n".join(header + lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
