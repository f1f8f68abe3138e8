"""The conformance harness: the fp32 oracle (and, later, the serving simulation and report)."""
from swafactory.harness.oracle import oracle_attention, tree_visibility

__all__ = ["oracle_attention", "tree_visibility"]
