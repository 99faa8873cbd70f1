"""The vocabulary every plane shares, importing nothing above it: a model, its routes, a
dynamic family and a bucket (`loaded.py`), the snapshot of what is served and what watches it
(`served.py`), where a request's tensors live (`layout.py`, `arena.py`), how a request fails
(`errors.py`, each error with a `kind`), the one dtype table (`dtypes.py`), `views.py` and
`spin.py`. The typed orders to workers are wire records, in protos/orders.py."""
