"""The engine: a plan becomes a served model.

`models.py` prepares registered models in the background; `engine.py` plans, splits, lays out
and builds them, then runs requests part by part; `handle.py` is the daemon's end of a device
worker and `worker.py` the worker itself; `orders.py` holds the typed messages between them;
`arena.py` is the shared memory tensors cross through; `dtypes.py` the one dtype table.
"""
