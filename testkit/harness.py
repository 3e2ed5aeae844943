"""Test harness helpers (not fixtures: those live in tests/conftest.py): the CLI run in-process,
folder-fsync failure injection, and the tensor comparisons of :mod:`testkit.tensors`."""

import os
import sys

from testkit.tensors import merged_tensors, same_bits

__all__ = ["fail_folder_fsync", "merged_tensors", "run_cli", "same_bits"]


def run_cli(args, monkeypatch, capsys):
    """Run ``mergepipe ARGS`` in-process through the console entry point (exit-code mapping
    included); returns (exit code, stdout, stderr)."""
    from mergepipe import cli

    monkeypatch.setattr(sys, "argv", ["mergepipe", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def fail_folder_fsync(monkeypatch) -> list[str]:
    """Make ``os.fsync`` fail with EIO on folder descriptors (as some network and FUSE file
    systems do), and work on files; returns the list of folders whose fsync was tried."""
    import errno
    import stat as stat_

    tried = []
    real = os.fsync

    def fsync(fd):
        if stat_.S_ISDIR(os.fstat(fd).st_mode):
            tried.append(os.readlink(f"/proc/self/fd/{fd}"))
            raise OSError(errno.EIO, "folder fsync refused")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return tried
