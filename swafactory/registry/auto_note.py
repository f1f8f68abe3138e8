"""What `backend=auto` chose and why, in words: the resolved name alone (``backend=torch``) hides
that auto kept its own fields (bf16 KV) where `backend=torch` composes fp32."""
from __future__ import annotations

from swafactory.config.schema import SwaFactoryConfig
from swafactory.registry.device import DeviceInfo
from swafactory.registry.suggest import AUTO_PREFERENCE

__all__ = ["auto_note"]

_KV = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def auto_note(asked: SwaFactoryConfig, resolved: SwaFactoryConfig, device: DeviceInfo) -> str | None:
    """``"auto → torch, bf16 KV: no CUDA device"`` when ``asked`` is `backend=auto` (``resolved``
    is `resolve_auto`'s answer on ``device``); None for a named backend."""
    if asked.backend.name != "auto":
        return None
    name, kv = resolved.backend.name, resolved.backend.kv_dtype
    prefs = AUTO_PREFERENCE.get(device.kind, ())
    if device.kind != "cuda":
        why = "no CUDA device"
    elif prefs and prefs[0] == name:
        why = f"the first of {', '.join(prefs)}"
    else:
        skipped = prefs[:prefs.index(name)] if name in prefs else prefs
        why = f"{', '.join(skipped)} refused for this combination"
    return f"auto → {name}, {_KV.get(kv, kv)} KV: {why}"
