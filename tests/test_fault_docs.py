"""The fault table of README.md and docs/faults.md is generated from conf/faults/*.yaml: it
matches them, has a row and every column for each fault, and a fault file without its lines is
named, not skipped."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from swafactory.config import paths
from swafactory.config.paths import group_options
from swafactory.outputs import fault_docs

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_hold_the_table_the_fault_files_give() -> None:
    assert fault_docs.sync(ROOT, check=True) == [], \
        "run python -m swafactory.outputs.fault_docs and commit the docs"


def test_every_fault_has_a_row_with_its_symptom_columns() -> None:
    rows = fault_docs.fault_rows()
    assert [r["name"] for r in rows] == [f for f in group_options("faults") if f != "none"]
    table = fault_docs.table()
    for r in rows:
        assert r["Reproduces"] and r["Users saw"] and r["Caught by"] and r["Guards off"], r
        assert f"| `{r['name']}`" in table
    assert "users saw" in table and "we show (guards off" in table


def test_a_fault_file_without_its_lines_is_named(tmp_path, monkeypatch) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(paths.conf_dir(), conf)
    path = conf / "faults" / "verify_as_decode.yaml"
    path.write_text("\n".join(x for x in path.read_text().splitlines()
                              if not x.startswith("# Users saw:")))
    monkeypatch.setattr(fault_docs, "conf_dir", lambda: conf)
    monkeypatch.setattr(paths, "conf_dir", lambda: conf)
    with pytest.raises(ValueError, match="verify_as_decode.yaml: add the comment lines # Users saw:"):
        fault_docs.fault_rows()


def test_a_stale_table_is_found_and_rewritten(tmp_path) -> None:
    for rel in fault_docs.DOCS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / rel).read_text()
        (tmp_path / rel).write_text(text.replace("| `verify_as_decode`", "| `verify_as_dekode`"))
    assert fault_docs.sync(tmp_path, check=True) == list(fault_docs.DOCS)
    assert fault_docs.sync(tmp_path) == list(fault_docs.DOCS)
    assert fault_docs.sync(tmp_path, check=True) == []
