"""Typed models of a run's records (part and file records, :mod:`mergepipe.commit.runs`).

A record is read back from storage, so it is untrusted input: it is parsed by one strict
pydantic model before any of its numbers or names is used (known keys only, format tag,
non-negative byte counts and times, 64-hex digests). This module imports only pydantic (no
torch, no numpy), so the operator's commit path uses the same models.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, ValidationError, model_validator

from mergepipe.errors import InputError

PART_FORMAT = "mergepipe.part/v1"
FILE_FORMAT = "mergepipe.file/v1"

_HEX64 = r"^[0-9a-f]{64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RealizedBytes(_Strict):
    """Bytes one attempt moved, per role (all >= 0; see :func:`mergepipe.result.realized_io`)."""

    base_read_bytes: NonNegativeInt = 0
    expert_read_bytes: NonNegativeInt = 0
    output_write_bytes: NonNegativeInt = 0
    output_copied_bytes: NonNegativeInt = 0
    catalog_read_bytes: NonNegativeInt = 0
    sketch_read_bytes: NonNegativeInt = 0


class FileInfo(_Strict):
    """An output file: its size (bytes) and content key, ``tree_sha256`` (a shard,
    :func:`mergepipe.engine.writer.tree_digest`) or ``sha256`` (any other file), 64 hex."""

    size: NonNegativeInt
    sha256: str | None = Field(default=None, pattern=_HEX64)
    tree_sha256: str | None = Field(default=None, pattern=_HEX64)

    @model_validator(mode="after")
    def _one_key(self) -> FileInfo:
        if (self.sha256 is None) == (self.tree_sha256 is None):
            raise ValueError("exactly one of sha256 and tree_sha256 is required")
        return self

    def key(self) -> str:
        """The content key (the tree digest or the SHA-256)."""
        return self.tree_sha256 or self.sha256 or ""

    def as_info(self) -> dict:
        """``{"size", "tree_sha256" | "sha256"}`` as the manifest lists it."""
        return self.model_dump(exclude_none=True)


class Attempt(_Strict):
    """An attempt (a random id) and the bytes it had moved."""

    id: str = Field(min_length=1, max_length=64)
    realized: RealizedBytes


class EarlierAttempt(_Strict):
    attempt: str = Field(min_length=1, max_length=64)
    realized: RealizedBytes


class FileRecord(_Strict):
    """A file record (``files/<name>.json``): one output file is complete and durable."""

    format: Literal["mergepipe.file/v1"]
    plan_digest: str = Field(pattern=_HEX64)
    run: str = Field(min_length=1, max_length=64)
    name: str = Field(min_length=1, max_length=1024)
    info: FileInfo
    base_tensor_sha256: dict[str, str]
    attempt: Attempt | None = None


class PartRecord(_Strict):
    """A part record (``part-<i>-of-<N>.json``): part ``part`` of ``parts`` is done.

    Attributes:
        files: output file name -> :class:`FileInfo` (what commit reads back and checks).
        realized: the final attempt's bytes per role (each <= the plan's, checked by
            :func:`mergepipe.commit.runs.check_parts`).
        started_at, wall_s: seconds (epoch; duration), >= 0.
    """

    format: Literal["mergepipe.part/v1"]
    plan_digest: str = Field(pattern=_HEX64)
    run: str = Field(min_length=1, max_length=64)
    part: NonNegativeInt
    parts: int = Field(ge=1)
    shards: list[str]
    files: dict[str, FileInfo]
    kept: list[str]
    base_tensor_sha256: dict[str, str]
    realized: RealizedBytes
    attempt: str = Field(min_length=1, max_length=64)
    earlier_attempts: list[EarlierAttempt] = []
    started_at: NonNegativeFloat
    wall_s: NonNegativeFloat
    device: str = Field(max_length=64)
    versions: dict[str, str] = {}

    @model_validator(mode="after")
    def _index(self) -> PartRecord:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} is not below parts {self.parts}")
        return self

    def as_dict(self) -> dict:
        """The record as plain JSON values (files as manifest infos)."""
        d = self.model_dump()
        d["files"] = {n: i.as_info() for n, i in self.files.items()}
        return d


def _one_line(e: ValidationError, where: str, what: str) -> InputError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ())) or what
    return InputError(f"{where}: {what} field {loc}: {err.get('msg')}.")


def parse_part_record(data: bytes | str, where: str) -> PartRecord:
    """Parse a part record.

    Raises:
        InputError: not JSON, an unknown key, a missing field, a negative number, a bad digest
            or format tag (one line naming ``where`` and the field, e.g.
            ``realized.expert_read_bytes``).
    """
    try:
        return PartRecord.model_validate_json(data)
    except ValidationError as e:
        raise _one_line(e, where, "part record") from None


def parse_file_record(data: bytes | str, where: str) -> FileRecord:
    """Parse a file record (same rules and errors as :func:`parse_part_record`)."""
    try:
        return FileRecord.model_validate_json(data)
    except ValidationError as e:
        raise _one_line(e, where, "file record") from None
