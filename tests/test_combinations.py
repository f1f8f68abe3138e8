"""The full product backends × specs × models has its verdicts pinned in a checked-in snapshot.

Regenerate after an intended change with `SWAFACTORY_UPDATE_SNAPSHOTS=1 pytest tests/test_combinations.py`
and review the diff: every changed verdict is a behaviour change.
"""
from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

from swafactory.config.paths import group_options
from swafactory.registry.device import CPU, H200
from swafactory.registry.matrix import shipped_config, verdict

SNAPSHOT = Path(__file__).parent / "snapshots" / "verdicts.json"


def _all_verdicts() -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    for dev_name, dev in (("cpu", CPU), ("h200", H200)):
        out[dev_name] = {
            f"backend={b} spec={s} model={m}": verdict(shipped_config(b, s, m), dev)
            for b, s, m in itertools.product(group_options("backend"), group_options("spec"),
                                             group_options("model"))}
    return out


def test_verdicts_match_the_snapshot() -> None:
    got = _all_verdicts()
    if os.environ.get("SWAFACTORY_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(json.dumps(got, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    want = json.loads(SNAPSHOT.read_text())
    changed = [f"{d} {k}: {want[d].get(k)} -> {v}" for d in got for k, v in got[d].items()
               if want.get(d, {}).get(k) != v]
    missing = [f"{d} {k}" for d in want for k in want[d] if k not in got.get(d, {})]
    assert not changed and not missing, "verdicts changed:\n" + "\n".join(changed + missing)


def test_snapshot_covers_the_whole_product_and_is_not_trivial() -> None:
    want = json.loads(SNAPSHOT.read_text())
    n = len(group_options("backend")) * len(group_options("spec")) * len(group_options("model"))
    assert len(want["cpu"]) == len(want["h200"]) == n
    for dev in ("cpu", "h200"):
        ok = [k for k, v in want[dev].items() if not v or v[0].startswith("→")]
        assert 0 < len(ok) < n, "a snapshot where everything passes or fails pins nothing"
