"""Device profiling: what this host has (`hardware.py`, read from the OS without importing
torch), micro-benchmarks run in a pinned subprocess (`benchmarks.py`), and measuring once and
caching by hardware fingerprint (`measure.py`)."""
