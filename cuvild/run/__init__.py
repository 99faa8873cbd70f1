"""The data plane: a request through its parts (request.py), the doorbells that ring a worker
(bells.py), dynamic batching. It never imports the control plane (cuvild/engine/__init__.py)."""
