"""What the command line does with a composed config: validate, then print and save the plan."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from swafactory.config.from_hydra import from_hydra
from swafactory.layout import PlanSummary, describe
from swafactory.registry.device import detect_device
from swafactory.registry.select import validate

__all__ = ["run_cli", "render_plan"]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _short(ids: str, limit: int = 18) -> str:
    return ids if len(ids) <= limit else ids[: ids.rfind(",", 0, limit)] + ",…"


def render_plan(plan: PlanSummary, console: Console) -> None:
    """Print the plan table and the pool bytes."""
    t = Table(title=f"swafactory plan: {plan.combination} on {plan.device}", title_justify="left")
    for col in ("worker", "group", "layers", "#", "pool", "index space", "KV heads×dim", "window",
                "tree", "resolver", "bytes/request"):
        t.add_column(col, no_wrap=col in ("layers", "KV heads×dim", "bytes/request"))
    for r in plan.rows:
        t.add_row(r.worker, r.group, _short(r.layers), str(r.num_layers), r.pool, r.index_space,
                  f"{r.kv_heads}×{r.head_dim}", str(r.window) if r.window else "-", r.tree,
                  r.resolver, _mib(r.bytes_per_request) if r.bytes_per_request else "-")
    console.print(t)
    console.print(
        f"kernel: {plan.rows[0].kernel if plan.rows else '-'}; page_size {plan.page_size}; kv_dtype "
        f"{plan.kv_dtype}; spec {plan.spec} (draft KV: {plan.draft_kv}); "
        f"{plan.max_running_requests} requests × {plan.context_len} tokens\n"
        f"bytes per context token past the window: hybrid {plan.hybrid_bytes_per_token:,} B vs "
        f"full-only {plan.full_only_bytes_per_token:,} B\n"
        f"bytes per request: hybrid {_mib(plan.hybrid_bytes_per_request)} vs full-only "
        f"{_mib(plan.full_only_bytes_per_request)} ({plan.saving:.2f}× smaller)"
        + (f"; draft pool {_mib(plan.draft_bytes_per_request)}" if plan.draft_bytes_per_request else "")
        + f"\npool tokens: full {plan.full_pool_tokens:,}, swa {plan.swa_pool_tokens:,}")


def run_cli(cfg: DictConfig, output_dir: Path | None) -> int:
    """Validate and run the composed config; returns the exit code. Raises ConfigError on refusal."""
    conf = from_hydra(cfg)
    device = detect_device(conf.workload.device)
    conf = validate(conf, device)
    plan = describe(conf, device)
    render_plan(plan, Console(file=sys.stdout, width=None if sys.stdout.isatty() else 140))
    if output_dir is not None:
        path = output_dir / "plan.json"
        path.write_text(json.dumps({"plan": plan.model_dump(), "config": conf.model_dump(mode="json")},
                                   indent=2))
        print(f"wrote {path}")
    return 0
