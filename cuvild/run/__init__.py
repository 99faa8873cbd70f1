"""The data plane: the Runner (runner.py) over a snapshot of what is served; a request through
its parts (request.py), the doorbells that ring a worker (bells.py), dynamic batching. It
never imports the control plane (tests/test_layout.py: it stands below it)."""
