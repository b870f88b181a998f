"""Device memory of one training step: the planner (plan.py, arithmetic) and the meter (meter.py)."""
