"""The data plane: a request through its parts (request.py), the doorbells and lanes that ring a
worker, dynamic batching. It never imports the control plane (cuvild/engine/__init__.py)."""
