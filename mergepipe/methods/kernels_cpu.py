"""Fused CPU kernels of the tiled task-arithmetic merge (C, compiled once per machine, ctypes).

The torch formulation of a tile (:func:`mergepipe.methods.kernels.task_arithmetic_combine`, and
the decode of a sketched run in :mod:`mergepipe.engine.sketchkernel`) is a chain of whole-tile
operations: per expert a gather of the sign codes from the row's value table (the codes widened
to int64 first), then ~6 elementwise passes of the sign election and the disjoint mean (weight,
``copysign``, ``mul``, ``relu``, ``sign``, ``add``), each reading and writing 256 KiB of float32.
The kernels here do the same float32 arithmetic, in the same order, in one pass per expert:

* ``build_codes``: the k-bit sign code of every entry of a sketched run from its planes' bits;
* ``gather_rows``: ``out[i] = T[row(i), code(i)]`` of a sign-plane run (``T`` the trimmed and
  scaled value table);
* ``rank1_rows``: ``hardshrink(u[row]·v[blk, col] + T[row, code], λ) · f`` of a rank-1 run;
* ``exact_bf16``: ``hardshrink(float32(x) − b, λ) · f`` of an exact bf16 piece;
* ``trim_scale``: ``hardshrink(δ, λ) · f`` in place (a float16/float32 exact or a LoRA piece);
* ``rank1_hist``: the exact-threshold histogram of a rank-1 run's decoded ``|δ̂|`` bit patterns,
  decoded and counted in one pass (nothing written);
* ``combine_sum`` / ``combine_plain``: TIES sign election and disjoint mean (``consensus: sum``)
  / the weighted sum (no consensus), normalize, ``lambda``, base, over the ``(K, n)`` float32 task
  vectors of a tile: per block of 2,048 entries, expert by expert, branch-free loops the compiler
  vectorises, each entry's sums still taken over the experts in plan order.

Every operation is a float32 IEEE operation (``-O3 -ffp-contract=off``, no fast-math: no FMA
contraction, no reassociation), so the results are bit-identical to the torch path's;
``tests/unit/test_kernels_cpu.py`` compares them on random tiles and edge cases. A tile whose
election sum is not finite (NaN or ±inf task vectors) is not merged here (``combine_sum`` returns
0): the caller runs the torch formulation, which defines those values.

Why C through ctypes (measured on the 2-core Xeon, docs/BENCHMARKS.md): numba gave the same
kernel speed but costs every merging process ~0.75 s of CPU (``import numba`` 0.33 s, then its
type registries, which import scipy, on the first call) and ~150 MiB of peak RSS (LLVM), more
than the kernels save on a 14M-parameter merge; a C++ extension through
``torch.utils.cpp_extension`` compiles against torch's headers (a one-line function: 39 s of CPU
once per machine). This source is
compiled by the system C compiler (``$CC``, else ``cc``) on first use, in ~0.3 s, into
``$XDG_CACHE_HOME/mergepipe/kernels`` (else ``~/.cache/...``; ``MERGEPIPE_KERNEL_CACHE``
overrides; a per-user temporary directory when that is not writable), keyed by the source,
flags and platform, and loaded with ctypes afterwards (~1 ms; a cached library loads without a
compiler). Without a cached library and a compiler, or with ``MERGEPIPE_KERNELS=torch``,
:func:`available` is False and the engine runs the torch path -- the one it always runs on a
CUDA device.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

SOURCE = r"""
#include <stdint.h>
#include <string.h>

#define BLK 2048

void build_codes(uint8_t *codes, const uint64_t *planes, int64_t k, const int64_t *blk_off,
                 const int64_t *blk_entries, int64_t nblk) {
    /* byte v -> its eight bits as eight 0/1 bytes in memory order (big-endian bits, as
       numpy.packbits): a code grows by one shift and one OR per plane per eight entries (no
       carry between bytes: a code has at most 8 bits) */
    uint64_t lut[256];
    for (int v = 0; v < 256; v++) {
        uint8_t e[8];
        for (int t = 0; t < 8; t++) e[t] = (uint8_t)((v >> (7 - t)) & 1);
        memcpy(&lut[v], e, 8);
    }
    for (int64_t b = 0; b < nblk; b++) {
        int64_t ne = blk_entries[b], full = ne >> 3;
        const uint8_t *pl[8];
        for (int64_t p = 0; p < k; p++) pl[p] = (const uint8_t *)(uintptr_t)planes[p] + blk_off[b];
        for (int64_t q = 0; q < full; q++, codes += 8) {
            uint64_t c = lut[pl[0][q]];
            for (int64_t p = 1; p < k; p++) c = (c << 1) | lut[pl[p][q]];
            memcpy(codes, &c, 8);
        }
        for (int64_t i = full << 3; i < ne; i++, codes++) { /* the block's last byte: padding bits cut */
            uint8_t c = 0;
            for (int64_t p = 0; p < k; p++) c = (uint8_t)((c << 1) | ((pl[p][i >> 3] >> (7 - (i & 7))) & 1));
            *codes = c;
        }
    }
}

void gather_rows(float *out, const uint8_t *codes, const float *table, int64_t tcols,
                 int64_t j0, int64_t j1, int64_t rn) {
    int64_t j = j0, o = 0;
    while (j < j1) {
        int64_t r = j / rn, end = (r + 1) * rn < j1 ? (r + 1) * rn : j1;
        const float *row = table + r * tcols;
        for (; j < end; j++, o++) out[o] = row[codes[j]];
    }
}

void rank1_rows(float *out, const uint8_t *codes, const float *table, int64_t tcols,
                const float *u, const float *v, int64_t rpb, int64_t j0, int64_t j1, int64_t rn,
                float lam, int has_lam, float f, int has_f) {
    int64_t j = j0, o = 0;
    if (!has_lam) lam = -1.0f; /* no x satisfies -(-1) <= x <= -1: nothing trimmed, NaN kept */
    while (j < j1) {
        int64_t r = j / rn, end = (r + 1) * rn < j1 ? (r + 1) * rn : j1;
        const float *row = table + r * tcols, *vb = v + (r / rpb) * rn;
        float ur = u[r];
        int64_t c0 = j - r * rn, len = end - j;
        const uint8_t *cj = codes + j;
        float *oj = out + o;
        if (tcols == 2) { /* one residual plane (the rank-1 tier): a select, not a gather: vectorises */
            float t0 = row[0], t1 = row[1];
            for (int64_t i = 0; i < len; i++) {
                float x = ur * vb[c0 + i];
                x = x + (cj[i] ? t1 : t0);
                oj[i] = (x >= -lam && x <= lam) ? 0.0f : x; /* hardshrink (NaN kept) */
            }
        } else {
            for (int64_t i = 0; i < len; i++) {
                float x = ur * vb[c0 + i];
                x = x + row[cj[i]];
                oj[i] = (x >= -lam && x <= lam) ? 0.0f : x;
            }
        }
        j = end;
        o += len;
    }
    if (has_f)
        for (int64_t i = 0; i < j1 - j0; i++) out[i] = out[i] * f;
}

void rank1_hist(const uint8_t *codes, const float *table, int64_t tcols, const float *u, const float *v,
                int64_t rpb, int64_t j0, int64_t j1, int64_t rn, int64_t lo, int64_t nbins, int64_t *hist) {
    /* decoded 256 entries at a time into a local buffer (rank1_rows' arithmetic; a vectorised
       select for one residual plane), then counted: few entries fall in a key group, so the
       counting loop's branch is predictable */
    float buf[256];
    int64_t j = j0;
    while (j < j1) {
        int64_t r = j / rn, end = (r + 1) * rn < j1 ? (r + 1) * rn : j1;
        const float *row = table + r * tcols, *vb = v + (r / rpb) * rn;
        float ur = u[r];
        while (j < end) {
            int64_t len = end - j < 256 ? end - j : 256, c0 = j - r * rn;
            const uint8_t *cj = codes + j;
            if (tcols == 2) {
                float t0 = row[0], t1 = row[1];
                for (int64_t i = 0; i < len; i++) {
                    float x = ur * vb[c0 + i];
                    buf[i] = x + (cj[i] ? t1 : t0);
                }
            } else {
                for (int64_t i = 0; i < len; i++) {
                    float x = ur * vb[c0 + i];
                    buf[i] = x + row[cj[i]];
                }
            }
            for (int64_t i = 0; i < len; i++) {
                uint32_t b;
                memcpy(&b, &buf[i], 4);
                uint64_t off = (uint64_t)((int64_t)(b & 0x7FFFFFFFu) - lo); /* |x| bit pattern - the group's first */
                if (off < (uint64_t)nbins) hist[off]++;
            }
            j += len;
        }
    }
}

void exact_bf16(float *out, const uint16_t *x, const float *b, int64_t n, float lam, int has_lam, float f,
                int has_f) {
    if (!has_lam) lam = -1.0f; /* nothing trimmed (see rank1_rows) */
    for (int64_t i = 0; i < n; i++) {
        uint32_t xb = (uint32_t)x[i] << 16, keep; /* bf16 -> float32: exact */
        float xv, d;
        memcpy(&xv, &xb, 4);
        d = xv - b[i];
        keep = (uint32_t)0 - (uint32_t)!(d >= -lam && d <= lam);
        memcpy(&xb, &d, 4);
        xb &= keep;
        memcpy(&d, &xb, 4);
        out[i] = has_f ? d * f : d;
    }
}

void trim_scale(float *x, int64_t n, float lam, int has_lam, float f, int has_f) {
    if (has_lam)
        for (int64_t i = 0; i < n; i++) x[i] = (x[i] >= -lam && x[i] <= lam) ? 0.0f : x[i];
    if (has_f)
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * f;
}

/* TIES over 16 entries at a time in GCC/Clang vector types (4 x 4 float32 lanes; each lane an
   IEEE float32 operation, so the values of the scalar code): the accumulators live in registers
   and each expert's row is streamed once per pass. (Arrays of accumulators in memory, 4 KiB
   apart from a row, alias in the store buffer: measured 6 ns instead of ~0.5 ns per expert
   entry at K = 8; and the compiler's own vectorisation of the scalar loops was unreliable.) */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

static inline v4f ld4(const float *p) { v4f r; memcpy(&r, p, 16); return r; }

static inline v4f sel(v4i mask, v4f x) { return (v4f)((v4i)x & mask); }

static int sum_scalar(float *out, const float *base, const float *d, int64_t ld, int64_t m, int64_t i,
                      const float *wk1, const float *w, int normalize, float lam, int has_lam) {
    const float tiny = 1.40129846e-45f; /* 2**-149: the divisor guard (clamp_min) */
    float tot = d[i] * wk1[0], acc = 0.0f, div = 0.0f;
    for (int64_t k = 1; k < m; k++) tot = tot + d[k * ld + i] * wk1[k];
    uint32_t b;
    memcpy(&b, &tot, 4);
    if ((b & 0x7F800000u) == 0x7F800000u) return 0;
    b = (b & 0x80000000u) | 0x3F800000u;
    float sgn;
    memcpy(&sgn, &b, 4);
    for (int64_t k = 0; k < m; k++) {
        float p = d[k * ld + i] * wk1[k] * sgn;
        if (p > 0.0f) {
            acc = acc + p;
            div = div + w[k];
        }
    }
    float a = acc * sgn;
    if (normalize) a = a / (div > tiny ? div : tiny);
    if (has_lam) a = a * lam;
    out[i] = base[i] - (0.0f - a);
    return 1;
}

int combine_sum(float *out, const float *base, const float *d, int64_t ld, int64_t m, int64_t n,
                const float *w, const uint8_t *wone, int normalize, float lam, int has_lam) {
    float wk1[256];
    if (m > 256) return 0;
    for (int64_t k = 0; k < m; k++) wk1[k] = wone[k] ? 1.0f : w[k]; /* x * 1.0f == x exactly */
    const v4f zero = {0.0f, 0.0f, 0.0f, 0.0f};
    const v4f tiny = {1.40129846e-45f, 1.40129846e-45f, 1.40129846e-45f, 1.40129846e-45f};
    const v4i expo = {0x7F800000, 0x7F800000, 0x7F800000, 0x7F800000};
    const v4i sbit = {(int32_t)0x80000000u, (int32_t)0x80000000u, (int32_t)0x80000000u, (int32_t)0x80000000u};
    const v4i onebits = {0x3F800000, 0x3F800000, 0x3F800000, 0x3F800000};
    int64_t i0 = 0;
    for (; i0 + 16 <= n; i0 += 16) {
        v4f tot[4], sgn[4], acc[4], div[4];
        v4i bad = {0, 0, 0, 0};
        for (int q = 0; q < 4; q++) tot[q] = ld4(d + i0 + 4 * q) * wk1[0];
        for (int64_t k = 1; k < m; k++) {
            const float *dk = d + k * ld + i0;
            for (int q = 0; q < 4; q++) tot[q] = tot[q] + ld4(dk + 4 * q) * wk1[k];
        }
        for (int q = 0; q < 4; q++) {
            v4i bits = (v4i)tot[q];
            bad |= (bits & expo) == expo; /* exponent all ones: inf or NaN */
            sgn[q] = (v4f)((bits & sbit) | onebits); /* copysign(1, total) */
            acc[q] = zero;
            div[q] = zero;
        }
        if (bad[0] | bad[1] | bad[2] | bad[3]) return 0;
        for (int64_t k = 0; k < m; k++) {
            const float *dk = d + k * ld + i0;
            float wk = wk1[k];
            v4f wd = {w[k], w[k], w[k], w[k]};
            for (int q = 0; q < 4; q++) {
                v4f p = ld4(dk + 4 * q) * wk * sgn[q];
                v4i pos = p > zero;
                acc[q] = acc[q] + sel(pos, p);
                div[q] = div[q] + sel(pos, wd);
            }
        }
        for (int q = 0; q < 4; q++) {
            v4f a = acc[q] * sgn[q];
            if (normalize) {
                v4i big = div[q] > tiny;
                a = a / (v4f)(((v4i)div[q] & big) | ((v4i)tiny & ~big));
            }
            if (has_lam) a = a * lam;
            v4f r = ld4(base + i0 + 4 * q) - (zero - a);
            memcpy(out + i0 + 4 * q, &r, 16);
        }
    }
    for (; i0 < n; i0++)
        if (!sum_scalar(out, base, d, ld, m, i0, wk1, w, normalize, lam, has_lam)) return 0;
    return 1;
}

void combine_plain(float *out, const float *base, const float *d, int64_t ld, int64_t m, int64_t n,
                   const float *w, float den, int has_den, float lam, int has_lam) {
    float mixed[BLK];
    for (int64_t i0 = 0; i0 < n; i0 += BLK) {
        int64_t nb = n - i0 < BLK ? n - i0 : BLK;
        for (int64_t k = 0; k < m; k++) {
            const float *dk = d + k * ld + i0;
            float wk = w[k];
            if (k == 0) for (int64_t j = 0; j < nb; j++) mixed[j] = dk[j] * wk;
            else for (int64_t j = 0; j < nb; j++) mixed[j] = mixed[j] + dk[j] * wk;
        }
        for (int64_t j = 0; j < nb; j++) {
            float x = mixed[j];
            if (has_den) x = x / den;
            if (has_lam) x = x * lam;
            out[i0 + j] = x == 0.0f ? base[i0 + j] : base[i0 + j] + x;
        }
    }
}
"""

#: compiler flags: IEEE float32 throughout (no FMA contraction, no fast-math), vectorised loops
#: (``-fno-trapping-math`` lets selects vectorise; it changes no value, only FP-exception flags)
CFLAGS = ["-O3", "-std=gnu99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math"]

_LIB: Any = None
_TRIED = False
_ERROR = ""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_N = ctypes.c_int
_SIGNATURES = {
    "build_codes": (None, [_P, _P, _I, _P, _P, _I]),
    "gather_rows": (None, [_P, _P, _P, _I, _I, _I, _I]),
    "rank1_rows": (None, [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _F, _N, _F, _N]),
    "trim_scale": (None, [_P, _I, _F, _N, _F, _N]),
    "exact_bf16": (None, [_P, _P, _P, _I, _F, _N, _F, _N]),
    "rank1_hist": (None, [_P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _P]),
    "combine_sum": (_N, [_P, _P, _P, _I, _I, _I, _P, _P, _N, _F, _N]),
    "combine_plain": (None, [_P, _P, _P, _I, _I, _I, _P, _F, _N, _F, _N]),
}


def _cache_dir() -> Path:
    env = os.environ.get("MERGEPIPE_KERNEL_CACHE")
    if env:
        return Path(env)
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "mergepipe" / "kernels"


def _compile() -> ctypes.CDLL:
    """Load the compiled :data:`SOURCE` from the cache, compiling it first when no cached copy
    exists (keyed by the source, flags and platform: a library built once, e.g. into an image's
    ``MERGEPIPE_KERNEL_CACHE``, loads without a compiler).

    Raises:
        OSError: no cached library and no C compiler, the compile failed, or the library does
            not load.
    """
    key = hashlib.sha256("\0".join([SOURCE, *CFLAGS, platform.machine(), sys.platform]).encode()).hexdigest()[:24]
    name = f"tile-{key}.so"
    dirs = [_cache_dir(), Path(tempfile.gettempdir()) / f"mergepipe-kernels-{os.getuid()}"]
    path = next((d / name for d in dirs if (d / name).exists()), None)
    if path is None:
        path = _build(dirs, name)
    _check_trusted(path)
    lib = ctypes.CDLL(str(path))
    for fname, (res, args) in _SIGNATURES.items():
        fn = getattr(lib, fname)
        fn.restype, fn.argtypes = res, args
    return lib


def _check_trusted(path: Path) -> None:
    """Refuse to load a shared library another user could have written.

    Loading a library runs its code, and the cache path is predictable (e.g. under a shared
    ``/tmp``), so the file and its directory must be owned by this user or by root (a library
    built into an image at build time) and writable by neither group nor others; symbolic links
    are not followed for the file. The same rule as OpenSSH's ``StrictModes`` for key files.

    Raises:
        OSError: naming the path and the owner or mode that makes it untrusted (the engine then
            runs the torch path; :func:`unavailable_reason` carries the message).
    """
    trusted_uids = {0, os.getuid()}
    for target, st in ((path.parent, os.stat(path.parent)), (path, os.lstat(path))):
        if target is path and not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file; refusing to load it as the kernel library")
        if st.st_uid not in trusted_uids:
            raise OSError(
                f"{target}: owned by uid {st.st_uid}, not by this user ({os.getuid()}) or root; refusing "
                "to load kernels from it (remove it, or set MERGEPIPE_KERNEL_CACHE to a private directory)"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise OSError(
                f"{target}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); refusing to load "
                "kernels from it (chmod go-w it, or set MERGEPIPE_KERNEL_CACHE to a private directory)"
            )


def _build(dirs: list[Path], name: str) -> Path:
    """Compile :data:`SOURCE` with ``$CC`` (else ``cc``) into the first writable of ``dirs``
    (the cache directory; else, e.g. under a read-only home, this user's temporary directory);
    the file appears atomically (a concurrent process loads either copy, both whole)."""
    cc = os.environ.get("CC") or "cc"
    exe = shutil.which(cc)
    if exe is None:
        raise OSError(f"no C compiler ({cc!r} not on PATH) and no compiled kernels in {dirs[0]}")
    for i, d in enumerate(dirs):
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                break
        except OSError:
            pass
        if i == len(dirs) - 1:
            raise OSError(f"no writable directory for the compiled kernels: {', '.join(map(str, dirs))}")
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        src, so = Path(tmp) / "tile.c", Path(tmp) / "tile.so"
        src.write_text(SOURCE)
        r = subprocess.run([exe, *CFLAGS, "-o", str(so), str(src)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise OSError(f"{cc} failed: {r.stderr.strip()[-400:]}")
        os.chmod(so, 0o755)  # whatever the umask: a group-writable library would be refused on load
        os.replace(so, d / name)
    return d / name


def available() -> bool:
    """True when the fused CPU kernels can run: ``MERGEPIPE_KERNELS`` is not ``torch`` and the
    library compiled and loaded (tried once per process; :func:`unavailable_reason` says why
    not)."""
    global _LIB, _TRIED, _ERROR
    if os.environ.get("MERGEPIPE_KERNELS", "").strip().lower() == "torch":
        return False
    if not _TRIED:
        _TRIED = True
        try:
            _LIB = _compile()
        except (OSError, subprocess.SubprocessError) as e:
            _LIB, _ERROR = None, str(e)
    return _LIB is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False (``""`` when it is True or was not asked)."""
    return "MERGEPIPE_KERNELS=torch" if os.environ.get("MERGEPIPE_KERNELS", "").strip().lower() == "torch" else _ERROR


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]  # (a third of ``a.ctypes.data``'s cost per call)


def _need(what: str, a: np.ndarray, dtype: type, size: int) -> None:
    """The C kernels index raw memory: refuse an array of the wrong dtype, not C-contiguous, or
    with fewer than ``size`` elements (sizes derive from stored statistics and sketch blobs, which
    are untrusted input) before any pointer is passed, so a damaged record raises instead of
    reading or writing out of bounds.

    Raises:
        ValueError: naming the argument, its dtype/layout/size and what was needed.
    """
    if a.dtype != dtype or not a.flags.c_contiguous or a.size < size:
        raise ValueError(
            f"fused kernel argument {what}: {a.dtype} {a.shape} (contiguous={a.flags.c_contiguous}); "
            f"needs C-contiguous {np.dtype(dtype).name} with >= {size} elements"
        )


def _rows_needed(j1: int, rn: int) -> int:
    return 0 if j1 <= 0 else (j1 - 1) // rn + 1


def build_codes(codes: np.ndarray, planes: list[np.ndarray], spans: list[tuple[int, int]]) -> None:
    """The k-bit sign code of every entry of a sketched run, from its planes' bits.

    Args:
        codes: uint8 ``(Σ entries,)`` C-contiguous (written): bit ``k − 1 − p`` of an entry's code
            is its bit in plane ``p`` (plane 1 most significant), as
            :meth:`mergepipe.engine.sketchkernel.SketchRun._prepared` builds them in torch.
        planes: the ``k <= 8`` planes' bytes (uint8, one per plane, the same block layout).
        spans: per block ``(first bit byte, entries)``: its sign bits start at that byte of every
            plane, big-endian within a byte (``numpy.packbits``); the padding bits of its last
            byte are skipped.
    """
    if not 1 <= len(planes) <= 8 or any(e < 0 or a < 0 for a, e in spans):
        raise ValueError(f"fused kernel build_codes: {len(planes)} planes, spans {spans[:4]}...")
    _need("codes", codes, np.uint8, sum(e for _, e in spans))
    for i, p in enumerate(planes):
        _need(f"planes[{i}]", p, np.uint8, max((a + (e + 7) // 8 for a, e in spans), default=0))
    ptrs = np.asarray([_ptr(p) for p in planes], dtype=np.uint64)
    off = np.asarray([a for a, _ in spans], dtype=np.int64)
    ne = np.asarray([e for _, e in spans], dtype=np.int64)
    _LIB.build_codes(_ptr(codes), _ptr(ptrs), len(planes), _ptr(off), _ptr(ne), len(spans))


def gather_rows(out: np.ndarray, codes: np.ndarray, table: np.ndarray, j0: int, j1: int, rn: int) -> None:
    """``out[i] = table[(j0 + i) // rn, codes[j0 + i]]`` for ``i < j1 − j0``.

    Args:
        out: float32 ``(j1 − j0,)``, C-contiguous (written).
        codes: uint8 ``(rows·rn,)`` sign codes of a run (:class:`~mergepipe.engine.sketchkernel.SketchRun`).
        table: float32 ``(rows, 2^k)`` C-contiguous value table.
        j0, j1: the run's flat elements to decode; rn: entries per row.
    """
    if not 0 <= j0 <= j1 or rn <= 0 or table.ndim != 2:
        raise ValueError(f"fused kernel gather_rows: j0={j0} j1={j1} rn={rn} table {table.shape}")
    _need("out", out, np.float32, j1 - j0)
    _need("codes", codes, np.uint8, j1)
    _need("table", table, np.float32, _rows_needed(j1, rn) * table.shape[1])
    _LIB.gather_rows(_ptr(out), _ptr(codes), _ptr(table), table.shape[1], j0, j1, rn)


def rank1_rows(
    out: np.ndarray,
    codes: np.ndarray,
    table: np.ndarray,
    u: np.ndarray,
    v: np.ndarray,
    rpb: int,
    j0: int,
    j1: int,
    rn: int,
    lam: float | None,
    f: float,
) -> None:
    """Rank-1 tier decode of the run's flat elements ``[j0, j1)`` into ``out`` (float32
    ``(j1 − j0,)``): ``x = u[r]·v[r // rpb, c]`` then ``x + table[r, code]`` (float32, the torch
    path's order), ``hardshrink(x, lam)`` when ``lam`` is given, times ``f`` when ``f != 1``.
    ``u`` float32 ``(rows,)``, ``v`` float32 ``(n_blocks, rn)``, C-contiguous.

    Raises:
        ValueError: an argument of the wrong dtype, layout or size (:func:`_need`)."""
    _check_rank1("rank1_rows", codes, table, u, v, rpb, j0, j1, rn)
    _need("out", out, np.float32, j1 - j0)
    _LIB.rank1_rows(
        _ptr(out), _ptr(codes), _ptr(table), table.shape[1], _ptr(u), _ptr(v), rpb, j0, j1, rn,
        0.0 if lam is None else lam, lam is not None, f, f != 1.0,
    )  # fmt: skip


def rank1_hist(
    hist: np.ndarray,
    codes: np.ndarray,
    table: np.ndarray,
    u: np.ndarray,
    v: np.ndarray,
    rpb: int,
    rows: int,
    rn: int,
    lo: int,
) -> None:
    """Add to ``hist`` (int64 ``(nbins,)``, C-contiguous; bin ``i`` counts the bit pattern
    ``lo + i`` of ``|δ|``) the decoded entries of a rank-1 run's ``rows`` rows (decoded as
    :func:`rank1_rows` without trim or factor), without writing them: the exact-threshold
    histogram of :class:`mergepipe.engine.chunk._GroupHist`, fused with the decode.

    Raises:
        ValueError: an argument of the wrong dtype, layout or size (:func:`_need`)."""
    _check_rank1("rank1_hist", codes, table, u, v, rpb, 0, rows * rn, rn)
    _need("hist", hist, np.int64, 1)
    _LIB.rank1_hist(
        _ptr(codes), _ptr(table), table.shape[1], _ptr(u), _ptr(v), rpb, 0, rows * rn, rn, lo, hist.shape[0], _ptr(hist)
    )


def _check_rank1(
    fn: str, codes: np.ndarray, table: np.ndarray, u: np.ndarray, v: np.ndarray, rpb: int, j0: int, j1: int, rn: int
) -> None:
    if not 0 <= j0 <= j1 or rn <= 0 or rpb <= 0 or table.ndim != 2:
        raise ValueError(f"fused kernel {fn}: j0={j0} j1={j1} rn={rn} rpb={rpb} table {table.shape}")
    rows = _rows_needed(j1, rn)
    _need("codes", codes, np.uint8, j1)
    _need("table", table, np.float32, rows * table.shape[1])
    _need("u", u, np.float32, rows)
    _need("v", v, np.float32, _rows_needed(rows, rpb) * rn)


def exact_bf16(out: np.ndarray, x: np.ndarray, b: np.ndarray, lam: float | None, f: float) -> None:
    """An exact bf16 piece's task vector: ``out = hardshrink(float32(x) − b, lam) · f`` (the trim
    when ``lam`` is given, the factor when ``f != 1``), the torch path's widening, subtraction,
    trim and scale in one pass. ``x``: the bf16 bit patterns (uint16 or int16 ``(n,)``); ``b``,
    ``out``: float32 ``(n,)``; all C-contiguous."""
    if x.dtype not in (np.uint16, np.int16):
        raise ValueError(f"fused kernel argument x: {x.dtype}; needs uint16/int16 bf16 bit patterns")
    _need("x", x, x.dtype.type, out.shape[0])
    _need("b", b, np.float32, out.shape[0])
    _need("out", out, np.float32, out.shape[0])
    _LIB.exact_bf16(
        _ptr(out), _ptr(x), _ptr(b), out.shape[0], 0.0 if lam is None else lam, lam is not None, f, f != 1.0
    )


def trim_scale(x: np.ndarray, lam: float | None, f: float) -> None:
    """In place on float32 contiguous ``x``: ``hardshrink(x, lam)`` (0 where ``−lam <= x <= lam``;
    NaN kept, as torch's) when ``lam`` is given, then ``x · f`` when ``f != 1``."""
    _need("x", x, np.float32, x.shape[0])
    _LIB.trim_scale(_ptr(x), x.shape[0], 0.0 if lam is None else lam, lam is not None, f, f != 1.0)


def combine_sum(
    out: np.ndarray, base: np.ndarray, d: np.ndarray, m: int, n: int, weights: list[float], normalize: bool, lam: float
) -> bool:
    """TIES combine of a tile (:func:`mergepipe.methods.kernels._sum_consensus_arith`, bit for bit).

    Args:
        out: float32 ``(n,)`` (written); base: float32 ``(n,)``.
        d: float32 ``(K, L)`` C-contiguous, ``L >= n``: rows ``[0, m)`` are the experts'
            sparsified, rescaled task vectors (entries ``[0, n)``), in plan order.
        weights: the ``m`` weights (float32 products, as torch multiplies by a Python float);
            with ``normalize`` every one must be positive in float32 (the caller checks).
        lam: ``lambda``.

    Returns:
        False when some election sum is NaN or ±inf (``out`` is then incomplete: run the torch
        combine), else True.
    """
    _check_combine("combine_sum", out, base, d, m, n, weights)
    w = np.asarray(weights, dtype=np.float32)
    wone = np.asarray([x == 1.0 for x in weights], dtype=np.uint8)
    return bool(
        _LIB.combine_sum(
            _ptr(out), _ptr(base), _ptr(d), d.shape[1], m, n, _ptr(w), _ptr(wone), normalize, lam, lam != 1.0
        )
    )


def combine_plain(
    out: np.ndarray,
    base: np.ndarray,
    d: np.ndarray,
    m: int,
    n: int,
    weights: list[float],
    den: float | None,
    lam: float,
) -> None:
    """Task-arithmetic combine of a tile without consensus (:func:`mergepipe.methods.kernels.
    task_arithmetic_combine`, bit for bit): ``Σ wₖδₖ`` in plan order, ``/ den`` (``normalize``;
    None: no division), ``· lam``, added to the base (the base where the sum is 0). Arguments as
    :func:`combine_sum`."""
    _check_combine("combine_plain", out, base, d, m, n, weights)
    w = np.asarray(weights, dtype=np.float32)
    _LIB.combine_plain(
        _ptr(out), _ptr(base), _ptr(d), d.shape[1], m, n, _ptr(w), 1.0 if den is None else den, den is not None,
        lam, lam != 1.0,
    )  # fmt: skip


def _check_combine(
    fn: str, out: np.ndarray, base: np.ndarray, d: np.ndarray, m: int, n: int, weights: list[float]
) -> None:
    if d.ndim != 2 or not 0 <= m <= d.shape[0] or not 0 <= n <= d.shape[1] or len(weights) < m:
        raise ValueError(f"fused kernel {fn}: d {d.shape}, m={m}, n={n}, {len(weights)} weights")
    _need("out", out, np.float32, n)
    _need("base", base, np.float32, n)
    _need("d", d, np.float32, d.size)
