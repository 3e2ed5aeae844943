"""Peak RSS of a merge does not grow with model size (the engine streams row chunks)."""

import json
import os
import subprocess
import sys

import pytest

from tests.synth import llama_like_shapes, make_family

SCRIPT = """
import json, sys
from mergepipe.catalog.catalog import Catalog
from mergepipe.pipeline import merge
base, out, cat = sys.argv[1], sys.argv[2], sys.argv[3]
experts = [(f"e{i}", p) for i, p in enumerate(sys.argv[4:])]
r = merge(base, experts, "ties", out, ["density=0.5"], catalog=Catalog(cat), work_bytes=8 << 20, prefetch_bytes=16 << 20)
print(json.dumps(r.summary()))
"""


def _peak_rss_mib(args, env) -> float:
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    out = p.stdout.read()
    assert os.waitstatus_to_exitcode(status) == 0, p.stderr.read().decode()
    json.loads(out)
    return ru.ru_maxrss / 1024.0


@pytest.mark.slow
def test_peak_rss_flat_in_model_size(tmp_path):
    env = dict(os.environ)
    small = make_family(tmp_path / "s", 2, seed=1, shapes=llama_like_shapes(256, 688, 2, 2048), n_shards=2)
    large = make_family(tmp_path / "l", 2, seed=2, shapes=llama_like_shapes(768, 2048, 4, 16384), n_shards=4)
    sizes = {k: sum(f.stat().st_size for f in fam[0].glob("*.safetensors")) for k, fam in (("s", small), ("l", large))}
    assert sizes["l"] > 20 * sizes["s"]
    rss = {}
    for k, (b, es) in (("s", small), ("l", large)):
        rss[k] = _peak_rss_mib([str(b), str(tmp_path / f"out-{k}"), str(tmp_path / f"c-{k}.sqlite"), *map(str, es)], env)
    # the large model is >20x bigger (its largest tensor alone is 24 MiB, 96 MiB as float32);
    # peak RSS may differ only by allocator noise, not by model size
    assert rss["l"] - rss["s"] < 64, f"peak RSS grew with model size: {rss} MiB for {sizes} bytes"
