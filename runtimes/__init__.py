"""The compile paths: one runtime per way of building and running a part (registry.py).

OpenVINO's model conversion and NNCF send usage telemetry to Google Analytics, with a client
id they write to ~/intel, unless the user opted out (`opt_in_out --opt_out`) or a CI
variable is set: from a daemon, on every part they build (~0.25-0.5 s a conversion here,
the sender's network wait; 0.12 s without). cuvild's processes send none: both libraries
send nothing where their telemetry package cannot be imported (their own fallback, for when
it is not installed), which this makes so before either is imported.
"""

import sys

sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
