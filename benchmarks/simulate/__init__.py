"""The simulator's development tools: `python -m benchmarks.simulate` (numaserve simulate from a checkout),
the sweep (sweep.py) and the step-cost fit (step_cost_fit.py). The simulator itself is numaserve/simulate/."""
