"""Device memory of one step: the planner (plan.py, buffers.py), its report.py, the meter.py."""
