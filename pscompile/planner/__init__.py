"""The planner: compiled mode's capture and passes on fake tensors, for machines one does not have
(``plan``, ``search``), with a cost model and a static-partition baseline (docs/paper-scale.md)."""

from pscompile.planner.hardware import HARDWARE, Hardware, calibrated, hardware_preset
from pscompile.planner.lora import LoRA
from pscompile.planner.plan import plan
from pscompile.planner.report import Baseline, PlanReport
from pscompile.planner.search import SearchResult, search

__all__ = ["plan", "search", "Hardware", "HARDWARE", "hardware_preset", "calibrated", "PlanReport", "Baseline",
           "SearchResult", "LoRA"]
