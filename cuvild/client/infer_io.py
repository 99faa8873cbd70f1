"""The client side of ModelInfer: tensors in and out as raw bytes or via shared memory."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cuvild.client.errors import CuvildError, InvalidArgument, convert_hint
from cuvild.core.dtypes import BY_OIP, oip_name
from protos import inference_pb2 as pb


def by_name(model: str, inputs: Any, specs: list[dict[str, Any]]) -> dict[str, Any]:
    """Inputs by the model's input names: from a tensor, a sequence in the model's order or a
    dict by name. InvalidArgument names the unknown and missing names, or the counts."""
    import torch

    names = [s["name"] for s in specs]
    if isinstance(inputs, (torch.Tensor, np.ndarray)):
        inputs = [inputs]
    if isinstance(inputs, Mapping):
        unknown = sorted(set(inputs) - set(names))
        missing = [n for n in names if n not in inputs]
        if unknown or missing:
            raise InvalidArgument("INVALID_ARGUMENT", f"model {model} takes inputs {names}; "
                                  + (f"unknown {unknown} " if unknown else "")
                                  + (f"missing {missing}" if missing else ""))
        return dict(inputs)
    if isinstance(inputs, Sequence):
        if len(inputs) != len(specs):
            raise InvalidArgument("INVALID_ARGUMENT", f"model {model} takes {len(specs)} "
                                  f"inputs {names}, got {len(inputs)}")
        return dict(zip(names, inputs, strict=True))
    raise TypeError("inputs: a tensor, a sequence of tensors or a dict name -> tensor")


def as_tensor(model: str, spec: dict[str, Any], value: Any) -> Any:
    """`value` as a contiguous host tensor of the dtype the model takes. A value of another
    dtype is refused, naming both and the conversion: it is never sent as reinterpreted bytes
    (an int32 array read as float32), nor converted behind the caller's back (float64 to
    float32 loses digits, int64 to int32 can overflow; the caller decides)."""
    import torch

    t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    t = t.detach()
    dtype = str(t.dtype).removeprefix("torch.")
    want = BY_OIP[spec["datatype"]].name if spec["datatype"] in BY_OIP else spec["datatype"]
    if dtype != want:
        raise InvalidArgument("INVALID_ARGUMENT", f"input {spec['name']!r}: {dtype}"
                              f"{list(t.shape)}, model {model} takes {want}{spec['shape']}; "
                              + convert_hint(want))
    return t.contiguous().cpu()


def _raw(t: Any) -> tuple[bytes, list[int]]:
    import torch

    return t.view(torch.uint8).numpy().tobytes(), list(t.shape)


def _tensor(data: bytes | memoryview, datatype: str, shape: list[int]) -> Any:
    import torch

    dtype = getattr(torch, BY_OIP[datatype].name)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape).clone()


def _daemon_uid(socket_path: str | None) -> int | None:
    """The daemon's user, from its socket's owner, when it is another user than this process
    and not root (who can open any object); None means mode 0600 alone will do."""
    if not socket_path:
        return None
    try:
        owner = os.stat(socket_path).st_uid
    except OSError:
        return None
    return None if owner in (os.getuid(), 0) else owner


def grant(path: str, uid: int) -> None:
    """Give user `uid` read and write on a 0600 object and nobody else anything (a POSIX ACL,
    what `setfacl -m u:<uid>:rw path` writes): the daemon may open a client's region, the
    other users of the daemon's group may not."""
    import struct

    entry = struct.Struct("<HHI")
    anyone = 0xFFFFFFFF
    acl = struct.pack("<I", 2) + b"".join(entry.pack(tag, perm, ident) for tag, perm, ident in (
        (0x01, 6, anyone),  # the owner: rw
        (0x02, 6, uid),  # the daemon's user: rw
        (0x04, 0, anyone),  # the owning group: nothing
        (0x10, 6, anyone),  # the mask: at most rw for named entries
        (0x20, 0, anyone)))  # everyone else: nothing
    try:
        os.setxattr(path, "system.posix_acl_access", acl)
    except OSError as e:
        raise RuntimeError(f"cannot let the daemon (uid {uid}) open {path}: {e.strerror} (this "
                           "/dev/shm takes no POSIX ACLs); call infer with shm=False") from None


class ClientRegion:
    """A shared-memory region this client owns and keeps registered between requests, so a
    request costs one ModelInfer call and no copies through the gRPC message. The object is
    mode 0600, and when the daemon runs as another user, that user alone is granted access:
    nobody else can read or change the tensors in it."""

    def __init__(self, stub: Any, timeout: float, socket_path: str | None = None) -> None:
        self.stub, self.timeout = stub, timeout
        self.segment: Any = None
        self.name = ""
        self.daemon_uid = _daemon_uid(socket_path)

    def ensure(self, nbytes: int) -> Any:
        from cuvild.core.arena import Segment

        if self.segment is not None and self.segment.size >= nbytes:
            return self.segment
        self.close()
        self.name = f"cuvil-client-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.segment = Segment(self.name, max(nbytes, 1 << 16), create=True, lock=False)
        if self.daemon_uid is not None:
            grant(f"/dev/shm/{self.name}", self.daemon_uid)
        self.register()
        return self.segment

    def register(self) -> None:
        """(Again) register the object: the daemon drops a caller's regions when its last
        connection closes, and a channel reconnects by itself after an idle close."""
        self.stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
            name=self.name, key=f"/{self.name}", offset=0, byte_size=self.segment.size),
            timeout=self.timeout)

    def close(self) -> None:
        if self.segment is None:
            return
        try:
            self.stub.SystemSharedMemoryUnregister(
                pb.SystemSharedMemoryUnregisterRequest(name=self.name), timeout=self.timeout)
        except Exception:  # noqa: BLE001 - the daemon may be gone; the segment still goes
            pass
        self.segment.close()
        self.segment = None


def run_infer(stub: Any, name: str, inputs: Any, region: ClientRegion | None, version: str,
              metadata: dict[str, Any], timeout: float) -> dict[str, Any]:
    values = by_name(name, inputs, metadata["inputs"])
    request = pb.ModelInferRequest(model_name=name, model_version=version)
    blobs = []
    for spec in metadata["inputs"]:
        t = as_tensor(name, spec, values[spec["name"]])
        data, shape = _raw(t)
        # labelled with what it holds: the daemon checks it against the model again
        request.inputs.add(name=spec["name"], shape=shape,
                           datatype=oip_name(str(t.dtype).removeprefix("torch.")))
        blobs.append(data)
    if region is None:
        request.raw_input_contents.extend(blobs)
        reply = stub.ModelInfer(request, timeout=timeout)
        return {o.name: _tensor(raw, o.datatype, list(o.shape))
                for o, raw in zip(reply.outputs, reply.raw_output_contents, strict=True)}
    return _infer_shm(stub, request, blobs, metadata, region, timeout)


def _infer_shm(stub: Any, request: Any, blobs: list[bytes], metadata: dict[str, Any],
               region: ClientRegion, timeout: float) -> dict[str, Any]:
    from cuvild.core.arena import align

    out_sizes: list[int | None] = []  # None: a dynamic shape, not known before the reply
    for spec in metadata["outputs"]:
        item = BY_OIP[spec["datatype"]].itemsize
        known = all(d >= 0 for d in spec["shape"])
        out_sizes.append(int(np.prod(spec["shape"])) * item if known else None)
    offsets, total = [], 0
    for n in [len(b) for b in blobs] + [n or 0 for n in out_sizes]:
        offsets.append(total)
        total += align(n)
    seg = region.ensure(total)
    for i, (blob, tensor) in enumerate(zip(blobs, request.inputs, strict=True)):
        seg.view(offsets[i], len(blob))[:] = blob
        _shm_params(tensor.parameters, region.name, offsets[i], len(blob))
    for j, spec in enumerate(metadata["outputs"]):
        out = request.outputs.add(name=spec["name"])
        if out_sizes[j] is not None:  # dynamic outputs come back as raw contents
            _shm_params(out.parameters, region.name, offsets[len(blobs) + j], out_sizes[j])
    try:
        reply = stub.ModelInfer(request, timeout=timeout)
    except CuvildError as e:
        if "unknown shared-memory region" not in e.message:
            raise
        region.register()  # dropped with an earlier connection: once more, then the call
        reply = stub.ModelInfer(request, timeout=timeout)
    results = {}
    for j, o in enumerate(reply.outputs):
        if out_sizes[j] is None:
            results[o.name] = _tensor(reply.raw_output_contents[j], o.datatype, list(o.shape))
        else:
            results[o.name] = _tensor(seg.view(offsets[len(blobs) + j], out_sizes[j]),
                                      o.datatype, list(o.shape))
    return results


def _shm_params(params: Any, region: str, offset: int, size: int) -> None:
    params["shared_memory_region"].string_param = region
    params["shared_memory_offset"].int64_param = offset
    params["shared_memory_byte_size"].int64_param = size
