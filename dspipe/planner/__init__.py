"""The planner: specs, hardware catalog, parallel layout, plan, estimates, search, DeepSpeed JSON rendering.

Imports neither torch nor deepspeed (a test checks it)."""
