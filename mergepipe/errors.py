"""Error types. Every error a user can cause is an :class:`InputError`: the CLI prints its
message (which names the file/field and the fix) and exits with code 2, before writing output."""


class MergepipeError(Exception):
    """Base class of mergepipe's own errors."""


class InputError(MergepipeError, ValueError):
    """Bad input: a file, URI, parameter or spec the user must fix. CLI exit code 2."""


class CommitConflict(MergepipeError):
    """The output path already holds a different snapshot (or another writer won the commit)."""
