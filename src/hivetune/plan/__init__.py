"""Memory and time planner: will a training config fit on a GPU, and how long will it take.

plan()                 predicted peak, largest micro-batch, time (planner.py)
auto_config()          batch_size / grad_accum / checkpointing that fit this device (auto.py)
smaller_micro_batch()  the next config to try after a CUDA out-of-memory error (auto.py)
"""

from hivetune.plan.auto import auto_config, smaller_micro_batch
from hivetune.plan.planner import Plan, format_plan, plan, plan_dict, plot_plan

__all__ = ["Plan", "auto_config", "format_plan", "plan", "plan_dict", "plot_plan", "smaller_micro_batch"]
