"""Process measurement, page-cache control and disk bandwidth for the benchmark harness.

How one run is measured (:func:`run_measured`, run inside a shim: ``python bench/measure.py
--result R.json -- CMD...``; the harness starts the shim and reads ``R.json``):

* Peak RSS is the command's own ``VmHWM`` (``/proc/<pid>/status``: the high-water mark of its
  address space, which ``exec`` starts afresh), sampled every ``interval`` seconds while it runs;
  ``VmHWM`` only grows, so the last sample before the exit is the peak up to the last
  ``interval``. ``ru_maxrss`` from ``wait4`` is recorded too but not used: Linux carries it over
  ``fork`` and ``exec`` (at ``exec`` the kernel folds the high-water mark of the address space
  being replaced into the process's ``maxrss``), so a command started from a large process
  (the harness holds numpy, tokenizers, possibly a trained zoo) reported at least that
  process's size: the first Qwen3 run read 3610 MiB for every mergepipe row, the harness's own
  size. The shim (``python bench/measure.py --result R.json -- CMD...``, a fresh small
  process) is kept so the ``ru_maxrss`` figure stays comparable.

* The harness starts the command itself (``subprocess.Popen``, no shell), so the wall time is
  the whole process: interpreter start-up, imports, work, exit. ``t0`` is taken just before the
  fork, ``t1`` when the kernel reports the exit.
* A waiter thread blocks in ``waitid(P_PID, pid, WEXITED | WNOWAIT)``: it returns when the
  process has exited but leaves it a zombie, so ``/proc/<pid>/io`` is still there and final
  (the kernel folds every exited thread, and every child the process reaped, into it). The
  harness reads it then, and only then reaps the process with ``os.wait4``, which gives the
  rusage: ``ru_maxrss`` (peak resident set, KiB, anonymous + file-backed, so mmap'd safetensors
  pages count), ``ru_utime``, ``ru_stime``.
* While the process runs, ``/proc/<pid>/status`` and ``/proc/<pid>/io`` are sampled every
  ``interval`` seconds (peak ``RssAnon``/``RssFile`` for context; the last ``io`` sample is a
  fallback should the final read fail).
* ``read_bytes``/``write_bytes`` of ``/proc/<pid>/io`` are bytes the process caused to be
  fetched from / dirtied for the block device: a page-cache hit reads 0, mmap'd reads count
  (``rchar`` does not see them, so it is recorded but not used), and written bytes count when
  the page is dirtied, whether or not they reach the disk before exit.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

IO_KEYS = ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes", "cancelled_write_bytes")


def _read_io(pid: int) -> dict | None:
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in IO_KEYS:
            out[k] = int(v)
    return out


def _read_status(pid: int) -> dict:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0])  # kB
    except OSError:
        pass
    return out


def run_measured(
    cmd: list[str],
    *,
    env: dict | None = None,
    cwd: str | None = None,
    stdout_path: Path | None = None,
    stderr_path: Path | None = None,
    interval: float = 0.02,
    timeout: float | None = None,
) -> dict:
    """Run ``cmd`` as a child process and measure it (see the module docstring).

    Returns a dict: ``cmd``, ``rc``, ``wall_s``, ``utime_s``, ``stime_s``, ``peak_rss_kib`` (sampled
    ``VmHWM``), ``peak_rss_source``, ``maxrss_kib`` (``ru_maxrss``, see the module docstring),
    ``peak_rss_anon_kib``, ``peak_rss_file_kib``, ``io`` (final ``/proc/<pid>/io``),
    ``io_source`` ("zombie" or "last-sample"), ``samples``, ``stdout`` (text, also written to
    ``stdout_path``).
    """
    so = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL
    se = open(stderr_path, "wb") if stderr_path else subprocess.DEVNULL
    try:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=so, stderr=se, stdin=subprocess.DEVNULL)
        exited = threading.Event()
        t_exit = [0.0]

        def waiter() -> None:
            os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
            t_exit[0] = time.perf_counter()
            exited.set()

        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        last_io = None
        peak_anon = peak_file = peak_hwm = 0
        n = 0
        deadline = None if timeout is None else t0 + timeout
        while not exited.wait(interval):
            st = _read_status(p.pid)
            peak_anon = max(peak_anon, st.get("RssAnon", 0))
            peak_file = max(peak_file, st.get("RssFile", 0))
            peak_hwm = max(peak_hwm, st.get("VmHWM", 0))
            io = _read_io(p.pid)
            if io:
                last_io = io
            n += 1
            if deadline is not None and time.perf_counter() > deadline:
                p.kill()
        th.join()
        final_io = _read_io(p.pid)  # the zombie's totals
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    finally:
        for f in (so, se):
            if hasattr(f, "close"):
                f.close()
    return {
        "cmd": [str(c) for c in cmd],
        "rc": p.returncode,
        "wall_s": t_exit[0] - t0,
        "utime_s": ru.ru_utime,
        "stime_s": ru.ru_stime,
        "peak_rss_kib": peak_hwm or ru.ru_maxrss,
        "peak_rss_source": "VmHWM" if peak_hwm else "ru_maxrss",
        "maxrss_kib": ru.ru_maxrss,
        "peak_rss_anon_kib": peak_anon,
        "peak_rss_file_kib": peak_file,
        "io": final_io or last_io or {},
        "io_source": "zombie" if final_io else "last-sample",
        "samples": n,
        "stdout": Path(stdout_path).read_text(errors="replace") if stdout_path else "",
    }


# ------------------------------------------------------------------------------------------
# page cache


def files_under(paths) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out.extend(q for q in sorted(p.rglob("*")) if q.is_file() and not q.is_symlink())
    return out


def drop_caches_permitted() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w"):
            pass
        return True
    except OSError:
        return False


def make_cold(mode: str, paths) -> str:
    """Empty the page cache before a cold run. ``mode``: ``drop`` (``sync; echo 3 >
    /proc/sys/vm/drop_caches``: everything, libraries included), ``fadvise``
    (``posix_fadvise(DONTNEED)`` on every file under ``paths``: inputs cold, libraries possibly
    warm), ``none``. Returns the method actually used."""
    os.sync()
    if mode == "drop":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    if mode == "fadvise":
        for f in files_under(paths):
            evict_file(f)
        return "fadvise"
    return "none"


def evict_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def warm(paths, chunk: int = 8 << 20) -> int:
    """Read every file under ``paths`` once (page cache warm-up); returns bytes read."""
    n = 0
    buf = bytearray(chunk)
    for f in files_under(paths):
        try:
            with open(f, "rb", buffering=0) as fh:
                while True:
                    k = fh.readinto(buf)
                    if not k:
                        break
                    n += k
        except OSError:
            pass
    return n


# ------------------------------------------------------------------------------------------
# disk bandwidth


def read_bandwidth(files: list[Path], max_bytes: int = 2 << 30, chunk: int = 16 << 20) -> dict:
    """Cold sequential read bandwidth: evict each file (fadvise DONTNEED), then read it with
    large ``read`` calls until ``max_bytes``; bytes / seconds."""
    files = [f for f in files if f.stat().st_size > 0]
    for f in files:
        evict_file(f)
    buf = bytearray(chunk)
    n = 0
    used = []
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                k = fh.readinto(buf)
                if not k:
                    break
                n += k
        used.append(str(f))
        if n >= max_bytes:
            break
    dt = time.perf_counter() - t0
    for f in files:
        evict_file(f)
    return {"bytes": n, "seconds": dt, "bytes_per_s": n / dt if dt > 0 else None, "files": len(used)}


def write_bandwidth(folder: Path, nbytes: int, chunk: int = 16 << 20) -> dict:
    """Sequential write bandwidth including ``fsync``: write ``nbytes`` of incompressible data to
    a scratch file in ``folder`` (same file system as the merge outputs), fsync, delete."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".bw-probe"
    block = os.urandom(min(chunk, max(nbytes, 1)))
    n = 0
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        while n < nbytes:
            k = min(len(block), nbytes - n)
            fh.write(block[:k])
            n += k
        os.fsync(fh.fileno())
    dt = time.perf_counter() - t0
    evict_file(path)
    path.unlink()
    return {"bytes": n, "seconds": dt, "bytes_per_s": n / dt if dt > 0 else None}


def main() -> None:
    """Shim entry point: run the command after ``--``, write the measurement as JSON."""
    import argparse
    import json
    import sys

    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: measure.py --result R.json [--stdout F] [--stderr F] [--timeout S] -- CMD ...")
    i = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--stdout", type=Path)
    ap.add_argument("--stderr", type=Path)
    ap.add_argument("--timeout", type=float)
    a = ap.parse_args(argv[:i])
    r = run_measured(argv[i + 1 :], stdout_path=a.stdout, stderr_path=a.stderr, timeout=a.timeout)
    a.result.write_text(json.dumps(r))


if __name__ == "__main__":
    main()
