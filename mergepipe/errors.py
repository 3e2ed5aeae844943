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

    A refusal of a request field is one of these with ``loc`` set; :attr:`field` is the same
    path as text (``planning.sketch``, ``experts[1].parameters.density``). The message is already
    rendered in the front end's terms by the ``where`` the request was resolved with
    (:meth:`mergepipe.request.MergeRequest.resolve`); a front end that names fields otherwise
    renders ``loc`` itself and prints ``problem`` after it.
    """

    def __init__(self, message: str = "", *, loc: tuple = (), problem: str | None = None) -> None:
        super().__init__(message)
        self.loc = tuple(loc)
        self.problem = message if problem is None else problem

    @property
    def field(self) -> str:
        """The request field at fault as a dotted path (``planning.budget``-style; list items as
        ``[i]``), or ``""`` when the error names no request field."""
        out = ""
        for k in self.loc:
            out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
        return out


#: a refused request field (:class:`InputError` with ``loc``); the name front ends catch
RequestError = InputError


class CommitConflict(MergepipeError):
    """The output path already holds a different snapshot (or another writer won the commit)."""
