"""The client side: the Python client (`Client`), `cuvilctl`, `make demo` and the sample models.

`from cuvild.client import Client` is the public entry point.
"""

from cuvild.client.api import Client, LoadFailed, default_target

__all__ = ["Client", "LoadFailed", "default_target"]
