"""The engine: a plan becomes a served model, in three rooms around a shared vocabulary.

- here, the vocabulary every plane shares: `loaded.py` (a prepared model and its routes),
  `layout.py` and `arena.py` (where a request's tensors live, the shared memory they cross
  through; the typed orders to workers are protos/orders.py), `errors.py` (how a request fails,
  each with a `kind` the serving layer maps to a status), `dtypes.py` (the one dtype table),
  `views.py`, `spin.py`, and `plane.py` (what each plane may read of the engine); and
  `engine.py`, the `Engine` that composes the planes;
- `cuvild/load/`, the control plane: served models, the precision search, load records
  (warm restarts), corrections, dynamic-shape buckets and the fallback off a failed device;
- `cuvild/run/`, the data plane: one request's parts (`request.py`), the doorbells that
  ring a worker (`bells.py`), dynamic batching; it never imports the control plane;
- `cuvild/workers/`, the device workers: the worker process, the daemon's handle on it, the
  part build, client-session serving and client regions, and the pool that starts, watches
  and revives them.
"""
