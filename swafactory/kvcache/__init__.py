"""KV-cache parts: pool sizing (and, later, pools, allocators and translation)."""
from swafactory.kvcache.sizing import GroupBytes, PoolSizing, pool_sizing

__all__ = ["GroupBytes", "PoolSizing", "pool_sizing"]
