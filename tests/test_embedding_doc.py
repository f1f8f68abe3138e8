"""docs/embedding.md and its sections (docs/embedding/*.md, in the index's order) are code: their
python blocks run in order, as one program, on CPU with the torch backend.

The guide checks every forward it makes against a plain fp32 attention it computes from the K/V
it wrote, so a block that raises or an assert that fails here is the guide (or the contract it
shows) being wrong.
"""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "embedding.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_SECTION = re.compile(r"\]\((embedding/[\w-]+\.md)\)")


def sections() -> list[Path]:
    """The index, then each section it links, in the index's order."""
    linked = list(dict.fromkeys(_SECTION.findall(DOC.read_text())))
    return [DOC] + [DOC.parent / p for p in linked]


def all_blocks() -> list[tuple[Path, int, str]]:
    """(file, first line number, code) of every ```python block of the guide, in order."""
    return [(p, line, code) for p in sections() for line, code in blocks(p.read_text())]


def blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block, in order."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def test_the_index_links_every_section() -> None:
    on_disk = sorted((DOC.parent / "embedding").glob("*.md"))
    assert sections()[1:] == on_disk, "docs/embedding.md must link every section, in file order"


def test_the_guide_has_its_sections_as_code() -> None:
    assert len(all_blocks()) >= 10  # the ten blocks of the guide when it was one file
    code = "\n".join(c for _, _, c in all_blocks())
    for needed in ("size_pools(", "build_pools(", "RequestSlots(", "evict_out_of_window(",
                   "truncate(", "finish(", "except CapacityError", "build_backend(cfg, pools=",
                   'view=View(dpool, pool, "draft_own_pool"', '"draft_reads_target"',
                   "fview.active_pool = frozen", "spec.draft_pool_split=true", "block=True",
                   "query_from=", "parents="):
        assert needed in code, f"docs/embedding*.md no longer shows {needed!r}"
    assert "windows=" not in code  # drafts are built with view= alone


def test_the_guide_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert __debug__, "the guide's asserts are its checks: do not run this test under -O"
    module = types.ModuleType("docs_embedding")  # a real module: the guide defines a dataclass
    monkeypatch.setitem(sys.modules, module.__name__, module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of tiny matmuls: extra threads only contend (30× slower)
    try:
        for path, line, code in all_blocks():
            # padded so a traceback's line numbers are the markdown file's
            compiled = compile("\n" * (line - 1) + code, str(path), "exec")
            try:
                exec(compiled, module.__dict__)  # noqa: S102 — the guide's own code, this repo
            except Exception as err:
                pytest.fail(f"{path.relative_to(DOC.parents[1])}, the block at line {line} failed: "
                            f"{type(err).__name__}: {err}")
    finally:
        torch.set_num_threads(threads)
