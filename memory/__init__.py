"""Device memory of one step: the planner (plan.py, buffers.py, model_size.py, choices.py), its
report.py, the meter.py."""
