"""Forward planning: a batch and the resolver's answer → per-layer-group tables, once per forward."""
from swafactory.metadata.batch import MODES, ForwardBatch, ForwardMode, ReqForward
from swafactory.metadata.plan import AttnTables, ForwardPlan, GroupPlan, group_key, plan

__all__ = ["MODES", "ForwardBatch", "ForwardMode", "ReqForward", "AttnTables", "ForwardPlan",
           "GroupPlan", "group_key", "plan"]
