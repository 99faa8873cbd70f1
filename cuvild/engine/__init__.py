"""The engine: a plan becomes a served model.

`models.py` prepares registered models in the background; `engine.py` plans, splits, lays out
and builds them, then runs requests (`request.py`: one request's parts, with its deadline and
one retry after a worker dies); `buckets.py` keeps a dynamic-shape model's built shapes
(bounded, least recently used evicted); `handle.py` is the daemon's end of a device worker and
`worker.py` the worker itself (`clientmem.py`: how it reaches clients' regions, size-checked on
every use); `orders.py` holds the typed messages between them; `errors.py` how a request fails
(each with a `kind` the serving layer maps to a status); `arena.py` is the shared memory
tensors cross through; `dtypes.py` the one dtype table.
"""
