"""The common layer: helpers that meta, worker and gateway share (ARCHITECTURE.md).

Nothing here imports meta, worker, gateway or the applications; tests/tier1/test_layers.py checks it.
"""
