"""Error types. Every error a user can cause is an :class:`InputError`: the CLI prints its
message (which names the file/field and the fix) and exits with code 2, before writing output."""


class MergepipeError(Exception):
    """Base class of mergepipe's own errors."""


class InputError(MergepipeError, ValueError):
    """Bad input: a file, URI, parameter or spec the user must fix. CLI exit code 2.

    Attributes:
        loc: the field of the :class:`mergepipe.request.MergeRequest` at fault, as a path
            (``("experts", 1, "parameters", "density", 0, "value")``; ``()`` when not known), so a
            front end can name it in its own terms (``--param math:density``,
            ``models[1].parameters.density``, ``spec.experts[0].parameters.density``).
        problem: the message without its location prefix (the whole message when none).
    """

    def __init__(self, message: str = "", *, loc: tuple = (), problem: str | None = None) -> None:
        super().__init__(message)
        self.loc = tuple(loc)
        self.problem = message if problem is None else problem


class CommitConflict(MergepipeError):
    """The output path already holds a different snapshot (or another writer won the commit)."""
