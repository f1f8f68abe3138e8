"""Does a distilled draft learn every prompt length, and does the target follow its language there?

Runs ``run=generate`` with a pretrained target and a distilled draft, and prints the accept
length, the draft's loss by distillation prompt length (a length it cannot learn stays near
chance, ln vocab), and the lowest share of the target's continuation tokens that follow the
lag-copy rule over those prompts. ``--heads wide`` pretrains the target on random heads up to
the longest prompt (`language.WIDE_HEADS`) rather than of ``lag`` tokens each;
``--lr`` sets the drafts' learning rate; ``--target-autocast bf16`` pretrains the target under
bf16 autocast (is Gemma 4's lag-1032 language, 2.1 s a step in fp32 on an H200, cheap enough
then, and does it still learn?).

    python bench/probes/distill_prompts.py --model gpt_oss_20b --family dflash [--heads lag]
        [--lr 3e-3] [--target-autocast bf16] [override ...]

Each run is its own process (cache: ``$SWAFACTORY_CACHE_DIR``); prints one JSON line last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_oss_20b")
    ap.add_argument("--family", default="dflash", help="a bench_generate acceptance family")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--heads", choices=("wide", "lag"), default="lag",
                    help="the target's training heads: up to the longest prompt, or the lag")
    ap.add_argument("--lr", type=float, default=None, help="the drafts' learning rate")
    ap.add_argument("--target-autocast", choices=("bf16",), default=None,
                    help="pretrain the target under this autocast (weights stay fp32)")
    ap.add_argument("override", nargs="*")
    a = ap.parse_args(argv)

    import swafactory
    from swafactory.drafts import distill, distill_features, language
    from swafactory.engine.run import run_generate

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_generate import FAMILIES

    language.WIDE_HEADS = a.heads == "wide"
    language.PRETRAIN = dataclasses.replace(language.PRETRAIN, autocast=a.target_autocast)
    if a.lr is not None:
        for mod, name in ((distill, "DISTILL"), (distill_features, "FEATURE_DISTILL"),
                          (distill_features, "BLOCK_DISTILL")):
            setattr(mod, name, dataclasses.replace(getattr(mod, name), lr=a.lr))
    over = [f"model={a.model}", f"backend={a.backend}", "run=generate", "workload=smoke",
            "run.target_weights=pretrained", *FAMILIES[a.family],
            *([] if a.family == "frozen_kv_mtp" else ["spec.draft_weights=distilled"]), *a.override]
    r = run_generate(swafactory.compose(over), progress=sys.stderr)
    d, t = r.draft_training or {}, r.target_training or {}
    print(json.dumps({"model": a.model, "family": a.family, "heads": a.heads, "lr": a.lr,
                      "target_autocast": a.target_autocast, "target_steps": t.get("steps"),
                      "status": r.status, "accept": r.accept_len, "most": r.max_accept_len,
                      "target_s": t.get("trained_s"), "target_top1": t.get("heldout_top1"),
                      "draft_s": d.get("trained_s"), "draft_top1": d.get("heldout_top1"),
                      "draft_steps": d.get("steps"), "target_follows": d.get("target_follows"),
                      "loss_by_prompt": d.get("loss_by_prompt")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
