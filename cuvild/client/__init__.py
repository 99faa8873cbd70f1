"""The client side: the Python client (`Client`), `cuvilctl`, `make demo` and the sample models.

`from cuvild.client import Client` is the public entry point; its calls raise the errors of
cuvild/client/errors.py (`CuvildError` and one class per status: `NotFound`, ...).
"""

from cuvild.client.api import Client, LoadFailed, default_target
from cuvild.client.errors import (
    AlreadyExists,
    CuvildError,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)

__all__ = ["AlreadyExists", "Client", "CuvildError", "DeadlineExceeded", "Internal",
           "InvalidArgument", "LoadFailed", "NotFound", "PermissionDenied", "ResourceExhausted",
           "Unavailable", "Unimplemented", "default_target"]
