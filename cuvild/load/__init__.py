"""The control plane: served models, the precision search, load records, corrections,
dynamic-shape buckets and the fallback off a device that fails to build
(cuvild/engine/__init__.py)."""
