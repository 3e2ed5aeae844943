"""bench/report_block.py: the generated-block helper of every bench report (write, check, print)."""

import pytest

from bench import report_block as rb

B, E = "<!-- t: begin (generated; do not edit) -->", "<!-- t: end -->"


def _doc(tmp_path, body="| a | 1 |\n"):
    doc = tmp_path / "DOC.md"
    doc.write_text(f"intro\n{B}\n{body}{E}\nrest\n")
    return doc


def test_write_then_check_then_a_hand_edit_is_caught(tmp_path, capsys):
    doc = _doc(tmp_path)
    blocks = [rb.Block("toy table", B, E, f"{B}\n| a | 2 |\n| b | 3 |\n{E}")]
    assert rb.main(["--check"], doc, lambda: blocks, "d", "bench/x.py") == 1
    err = capsys.readouterr().err
    assert "the toy table: line 2 of the block differs" in err and "python bench/x.py --write" in err
    assert rb.main(["--write"], doc, lambda: blocks, "d", "bench/x.py") == 0
    assert doc.read_text() == f"intro\n{B}\n| a | 2 |\n| b | 3 |\n{E}\nrest\n"  # the rest kept byte for byte
    assert rb.main(["--check"], doc, lambda: blocks, "d", "bench/x.py") == 0
    doc.write_text(doc.read_text().replace("| b | 3 |", "| b | 4 |"))
    assert rb.differences(doc, blocks) == ["DOC.md: the toy table: line 3 of the block differs from the re-derivation"]
    # a trailing-space edit is a difference too
    doc.write_text(doc.read_text().replace("| b | 4 |", "| b | 3 | "))
    assert rb.differences(doc, blocks)


def test_check_exit_code_comes_from_the_kind_of_mismatch_not_its_wording(tmp_path):
    """A differing block is exit 1 even when its label reads like the missing-marker message."""
    doc = _doc(tmp_path)
    blocks = [rb.Block("no generated block table", B, E, f"{B}\n| a | 2 |\n{E}")]
    assert rb.main(["--check"], doc, lambda: blocks, "d", "bench/x.py") == 1


def test_missing_markers_exit_2_and_write_nothing(tmp_path, capsys):
    doc = tmp_path / "DOC.md"
    doc.write_text(f"intro\n{B}\nno end marker\n")
    ok = rb.Block("other", "<!-- o: begin -->", "<!-- o: end -->", "<!-- o: begin -->\nx\n<!-- o: end -->")
    blocks = [ok, rb.Block("toy table", B, E, f"{B}\nx\n{E}")]
    before = doc.read_text()
    assert rb.main(["--write"], doc, lambda: blocks, "d", "bench/x.py") == 2
    assert doc.read_text() == before
    assert "no generated block for the other" in capsys.readouterr().err
    assert rb.main(["--check"], doc, lambda: blocks, "d", "bench/x.py") == 2
    # the end marker must follow the begin marker
    doc.write_text(f"{E}\n{B}\n")
    assert rb.span(doc.read_text(), B, E) is None


def test_bare_call_prints_or_writes(tmp_path, capsys):
    doc = _doc(tmp_path)
    blocks = [rb.Block("toy table", B, E, f"{B}\nnew\n{E}")]
    assert rb.main([], doc, lambda: blocks, "d", "bench/x.py") == 0
    assert capsys.readouterr().out == f"{B}\nnew\n{E}\n" and "new" not in doc.read_text()
    assert rb.main([], doc, lambda: blocks, "d", "bench/x.py", bare_writes=True) == 0
    assert f"{B}\nnew\n{E}" in doc.read_text()


def test_a_rendering_without_its_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        rb.Block("toy table", B, E, "| a | 1 |\n")
