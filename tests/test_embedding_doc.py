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


@pytest.fixture
def guide(monkeypatch: pytest.MonkeyPatch):
    """A fresh module for the guide's blocks to run in, one torch thread while they do."""
    assert __debug__, "the guide's asserts are its checks: do not run this test under -O"
    module = types.ModuleType("docs_embedding")  # a real module: the guide defines a dataclass
    monkeypatch.setitem(sys.modules, module.__name__, module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of tiny matmuls: extra threads only contend (30× slower)
    try:
        yield module
    finally:
        torch.set_num_threads(threads)


def run_blocks(module: types.ModuleType, until: str | None = None) -> None:
    """Run the guide's blocks in order in ``module``, through the first that holds ``until``
    (None: all of them)."""
    for path, line, code in all_blocks():
        # padded so a traceback's line numbers are the markdown file's
        compiled = compile("\n" * (line - 1) + code, str(path), "exec")
        try:
            exec(compiled, module.__dict__)  # noqa: S102 — the guide's own code, this repo
        except Exception as err:
            pytest.fail(f"{path.relative_to(DOC.parents[1])}, the block at line {line} failed: "
                        f"{type(err).__name__}: {err}")
        if until is not None and until in code:
            return
    assert until is None, f"no block of the guide holds {until!r}"


def test_the_guide_runs(guide: types.ModuleType) -> None:
    run_blocks(guide)


@pytest.mark.parametrize("model", ["tiny", "gemma4"])
def test_the_guides_reference_takes_the_models_scale(guide: types.ModuleType, model: str) -> None:
    """The guide's engine and `plain_attention` on another model than its own: Gemma 4 scales
    scores by 1.0 (model.softmax_scale), not head_dim^-0.5, so a reference that hard-codes the
    latter fails here. A prefill of two requests, then a decode, over the first six layers
    (Gemma 4's first five sliding ones and a full one)."""
    import swafactory
    from swafactory.kvcache import ReqToToken, RequestSlots, size_pools
    from swafactory.kvcache.factory import build_pools
    from swafactory.metadata import ReqForward

    run_blocks(guide, until="def plain_attention(")
    g = guide.__dict__
    torch.manual_seed(0)
    cfg = swafactory.validate(swafactory.compose([f"model={model}", "backend=torch", "spec=none"]))
    m = cfg.model
    sizes = size_pools(cfg, max_requests=2, max_context=48, chunk=16)
    pool, alloc = build_pools(cfg, sizes.full, sizes.swa)
    backend = swafactory.build_backend(cfg, pools=pool)
    full = m.full_layers[0]
    assert backend.layer_scale(full) == (m.softmax_scale or m.full.head_dim ** -0.5)
    if model == "gemma4":
        assert backend.layer_scale(full) == 1.0 != m.full.head_dim ** -0.5
    book = RequestSlots(alloc, ReqToToken(2, sizes.full_per_request))
    layers = dict(list(g["target_layers"](cfg).items())[:6])
    assert any(w is None for w, _, _ in layers.values()) and full in layers
    prompt, mem = {"a": 20, "b": 13}, g["Written"]()
    reqs = []
    for rid, n in prompt.items():
        row = book.open(rid).row
        book.extend(rid, n)
        reqs.append(ReqForward(rid, row, 0, n))
    g["forward"](backend, book, "extend", reqs, layers, mem)  # asserts against plain_attention
    book.decode(list(prompt))
    g["forward"](backend, book, "decode", [ReqForward(rid, book.reqs[rid].row, n, 1)
                                           for rid, n in prompt.items()], layers, mem)
