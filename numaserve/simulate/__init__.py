"""A discrete-event simulator of a numaserve deployment at scale, for capacity planning: the real routing,
batching, admission and speculation-policy code (scheduling/) against modelled workers (step_cost.py), no Ray
and no numba kernels.

    numaserve simulate --workers N --machines M --rate R --duration-s S \\
        --trace poisson|bursty|sessions|adapters --seed K --json OUT
    python -m benchmarks.simulate ...            # the same command from a source checkout
    python -m benchmarks.simulate.sweep          # workers 1..256 per trace and policy variant: JSON + PNG
"""
