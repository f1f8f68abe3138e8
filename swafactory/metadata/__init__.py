"""Forward planning: a batch and the resolver's answer → per-layer-group tables, once per forward."""
from swafactory.metadata.batch import MODES, ForwardBatch, ForwardMode, ReqForward
from swafactory.metadata.plan import AttnTables, ForwardPlan, GroupPlan, group_key, plan
from swafactory.metadata.spec_tables import prepare_spec_page_table

__all__ = ["MODES", "ForwardBatch", "ForwardMode", "ReqForward", "AttnTables", "ForwardPlan",
           "GroupPlan", "group_key", "plan", "prepare_spec_page_table"]
