"""The engine: a plan becomes a served model, in rooms that stand one above the other.

- `engine.py` (here): `Engine`, the wiring of the rooms below, and nothing else;
- `cuvild/load/`, the control plane: the `Builder` (builder.py), which alone publishes what is
  served; a model's load (prepare.py), load records (warm.py), the precision search,
  corrections, dynamic-shape buckets (buckets.py) and the fallback off a failed device;
- `cuvild/run/`, the data plane: the `Runner` (runner.py), which reads the served snapshot;
  one request's parts (request.py), the doorbells that ring a worker (bells.py), batching;
- `cuvild/workers/`, the device workers: the worker process, the daemon's handle on it, the
  part build, client-session serving and client regions, and the pool that starts, watches
  and revives them;
- `cuvild/core/`, the vocabulary every plane shares.
"""
