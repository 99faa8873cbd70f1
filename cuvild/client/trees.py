"""The model's own output container, rebuilt in the client from the outputs by name.

The daemon keeps a model's output tree spec as uploaded (cuvild/intake/trees.py) and names
each output by its field path. A client that has the container's class registered with
torch's pytree (transformers registers every ModelOutput when it is imported; a user's
dataclass when its module calls torch.export.register_dataclass) gets that container back;
otherwise, and for tuples, lists, dicts and lone tensors, the dict by name. Nothing named by
the spec is imported: a type the client has not registered itself is never looked up.
"""

from __future__ import annotations

import json
import re
from typing import Any

from cuvild.intake.trees import PLAIN_TYPES

_POSITIONAL_RE = re.compile(r"output\d+(\..*)?")


def positional(outputs: dict[str, Any]) -> bool:
    """Whether every output is named by position (`output0`, `output1.x`): the model returns
    a tuple, a list or a lone tensor, never a container of its own."""
    return all(_POSITIONAL_RE.fullmatch(name) for name in outputs)


def container_spec(out_spec: str) -> Any:
    """The TreeSpec to rebuild outputs with, or None when the dict by name is the answer
    (no spec, a builtin container at the root, or a type this process has not registered)."""
    if not out_spec:
        return None
    try:
        root = json.loads(out_spec)[1]
    except (ValueError, TypeError, IndexError, KeyError, RecursionError):
        return None  # (nested past the interpreter's depth: the dict by name)
    if not isinstance(root, dict) or root.get("type") in (None, *PLAIN_TYPES):
        return None
    import torch.utils._pytree as pytree

    from cuvild.intake.grammar import Reject, check_treespec

    _transformers_outputs(root["type"])
    try:  # only registered types, no enum (module import) contexts, no defaultdict factories
        check_treespec(out_spec, "out_spec")
        return pytree.treespec_loads(out_spec)
    except (Reject, NotImplementedError, TypeError, ValueError, RecursionError):
        return None


# transformers' output classes (ModelOutput subclasses register with pytree when their module
# is imported): its shared module, or one model's modeling module
_TRANSFORMERS_MODULE = re.compile(
    r"transformers\.(modeling_outputs|models\.[a-z0-9_]+\.modeling_[a-z0-9_]+)")


def _transformers_outputs(type_name: str) -> None:
    """Import the transformers module that defines `type_name`, where this process imported
    transformers itself: transformers 5 loads its modules lazily, so `import transformers`
    alone registers no ModelOutput and the caller would get a dict. Only modules of the
    installed transformers package, by that fixed pattern, and never transformers itself."""
    import importlib
    import sys

    module = type_name.rpartition(".")[0]
    if "transformers" in sys.modules and _TRANSFORMERS_MODULE.fullmatch(module):
        try:
            importlib.import_module(module)
        except ImportError:  # another transformers version: the dict by name
            pass


def rebuild(spec: Any, names: list[str], outputs: dict[str, Any]) -> Any:
    """`outputs` (by name) in the container of `spec` (container_spec), or the dict itself
    when there is none or an output is missing."""
    if spec is None or any(n not in outputs for n in names):
        return outputs
    import torch.utils._pytree as pytree

    try:
        return pytree.tree_unflatten([outputs[n] for n in names], spec)
    except RecursionError:  # a spec nested past the interpreter's depth: the dict will do
        return outputs
