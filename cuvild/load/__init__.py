"""The control plane: the Builder (builder.py), which alone publishes what is served; a
model's load (prepare.py), served models (models.py), the precision search, load records,
corrections, dynamic-shape buckets and the fallback off a device that fails to build."""
