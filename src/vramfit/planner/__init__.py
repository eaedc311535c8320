"""Memory planner: the device memory of one steady-state training step, predicted without a GPU.

docs/memory.md has the long form. The parts, one concern each:

- `tracing`: the exact model and optimizer on fake tensors, one training step recorded op by op
  (with CUDA's autocast rules on CPU), giving the ordered log of allocations and frees;
- `estimate`: two traces make every allocation `a + b * micro_batch`; the peak at any micro-batch,
  the named constants for what the trace cannot see, and the pick for a memory budget;
- `advice`: when a step does not fit, the cheapest changes that make it fit;
- `report`: `vramfit plan` (the dict behind --json and plan.json, and its text).
- `size_picks`: the planner's micro-batch at each image size of a progressively resized run.
"""

from .advice import advise, config_with, lighter_backbones
from .estimate import (ALLOCATOR_OVERHEAD_FRACTION, CUDA_CONTEXT_BYTES, CUDA_WORKSPACE_BYTES,
                       DEFAULT_NUM_CLASSES, REPORTED_FRACTION, REPORTED_GIB, SEGMENT_BYTES,
                       TRACE_BATCHES, MemoryEstimate, Profile, allocator_reserve, budget_bytes_for,
                       bytes_text, clear_profiles, estimate, estimate_model, estimate_table, get_profile,
                       pick_micro_batch, reported_total_bytes)
from .report import format_plan, run_plan
from .tracing import (ACT, BUFFER, BWD, CATEGORY_NAMES, CUDA_AUTOCAST_POLICY, CUDA_ONLY_OPS, GRAD, HOST,
                      INPUT, OPT, PARAM, STEP, WCAST, cuda_autocast_rules_on_cpu)

__all__ = [
    "ACT", "ALLOCATOR_OVERHEAD_FRACTION", "BUFFER", "BWD", "CATEGORY_NAMES", "CUDA_AUTOCAST_POLICY",
    "CUDA_CONTEXT_BYTES", "CUDA_ONLY_OPS", "CUDA_WORKSPACE_BYTES", "DEFAULT_NUM_CLASSES", "GRAD", "HOST",
    "INPUT", "MemoryEstimate", "OPT", "PARAM", "Profile", "REPORTED_FRACTION", "REPORTED_GIB",
    "SEGMENT_BYTES", "STEP", "TRACE_BATCHES", "WCAST", "advise", "allocator_reserve", "budget_bytes_for",
    "bytes_text", "clear_profiles", "config_with", "cuda_autocast_rules_on_cpu", "estimate", "estimate_model",
    "estimate_table", "format_plan", "get_profile", "lighter_backbones", "pick_micro_batch",
    "reported_total_bytes", "run_plan",
]
