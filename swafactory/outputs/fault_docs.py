"""The fault table of README.md and docs/faults.md, generated from `conf/faults/*.yaml`, so the
docs cannot drift from the catalog.

Each fault file states, in comment lines beside its `# Launch:` line: what it needs besides its
own switch (`# Needs:`), the bug it reproduces (`# Reproduces:`), what the bug's users saw
(`# Users saw:`), the check that catches it with the guards on (`# Caught by:`) and what it
shows with them off, as an engine runs (`# Guards off:`). `python -m swafactory.outputs.fault_docs`
rewrites the table between the markers of both documents; `--check` exits 1 where one differs
(tests/test_fault_docs.py runs it).
"""
from __future__ import annotations

import sys
from pathlib import Path

from swafactory.config.paths import conf_dir, group_options

__all__ = ["FIELDS", "fault_rows", "table", "sync", "main"]

FIELDS = ("Needs", "Reproduces", "Users saw", "Caught by", "Guards off")
"""The comment lines each `conf/faults/<name>.yaml` carries, in the table's column order."""
BEGIN = ("<!-- fault table: generated from conf/faults/*.yaml by "
         "`python -m swafactory.outputs.fault_docs`; edit those files, not this table -->")
END = "<!-- /fault table -->"
DOCS = ("README.md", "docs/faults.md")


def fault_rows() -> list[dict[str, str]]:
    """One dict per fault (``name`` and `FIELDS`), in name order. Raises ValueError naming
    the file and the missing lines when a fault file lacks one."""
    rows = []
    for name in group_options("faults"):
        if name == "none":
            continue
        path = conf_dir() / "faults" / f"{name}.yaml"
        row = {"name": name}
        for line in path.read_text().splitlines():
            for field in FIELDS:
                if line.startswith(f"# {field}: "):
                    row[field] = line[len(field) + 4:].strip()
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: add the comment lines {', '.join(f'# {m}:' for m in missing)}"
                             " (the fault table is generated from them)")
        rows.append(row)
    return rows


def _cell(text: str) -> str:
    return "-" if text in ("", "-") else text.replace("|", "\\|")


def table() -> str:
    """The markdown table, its markers included."""
    out = [BEGIN, "",
           "| `faults=` (needs) | reproduces | users saw | caught by (guards on) | "
           "we show (guards off, as an engine runs) |", "|---|---|---|---|---|"]
    for r in fault_rows():
        needs = "" if r["Needs"] in ("", "-") else f" ({r['Needs']})"
        out.append(f"| `{r['name']}`{needs} | {_cell(r['Reproduces'])} | {_cell(r['Users saw'])} "
                   f"| {_cell(r['Caught by'])} | {_cell(r['Guards off'])} |")
    return "\n".join([*out, "", END])


def sync(root: Path, check: bool = False) -> list[str]:
    """Write `table` between the markers of each of `DOCS` under ``root``; returns the files
    that differed (with ``check``: written nothing). Raises ValueError naming a document that
    lacks the markers."""
    want, stale = table(), []
    for rel in DOCS:
        path = root / rel
        text = path.read_text()
        if BEGIN not in text or END not in text:
            raise ValueError(f"{path}: put the fault table's markers in it ({BEGIN} … {END})")
        head, rest = text.split(BEGIN, 1)
        new = head + want + rest.split(END, 1)[1]
        if new != text:
            stale.append(rel)
            if not check:
                path.write_text(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    stale = sync(Path.cwd(), check=check)
    for rel in stale:
        print(f"{rel}: the fault table {'differs from' if check else 'rewritten from'} "
              "conf/faults/*.yaml" + ("; run python -m swafactory.outputs.fault_docs" if check
                                      else ""))
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
