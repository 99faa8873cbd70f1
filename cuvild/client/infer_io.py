"""The client side of ModelInfer: tensors in and out as raw bytes or via shared memory."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from cuvild.engine.dtypes import BY_OIP
from protos import inference_pb2 as pb


def _by_name(inputs: Any, specs: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    if isinstance(inputs, (torch.Tensor, np.ndarray)):
        inputs = [inputs]
    if isinstance(inputs, Mapping):
        return dict(inputs)
    if isinstance(inputs, Sequence):
        if len(inputs) != len(specs):
            raise ValueError(f"model takes {len(specs)} inputs, got {len(inputs)}")
        return {s["name"]: t for s, t in zip(specs, inputs, strict=True)}
    raise TypeError("inputs: a tensor, a sequence of tensors or a dict name -> tensor")


def _raw(value: Any) -> tuple[bytes, list[int]]:
    import torch

    t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    t = t.detach().contiguous().cpu()
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
        from cuvild.engine.arena import Segment

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
    values = _by_name(inputs, metadata["inputs"])
    request = pb.ModelInferRequest(model_name=name, model_version=version)
    blobs = []
    for spec in metadata["inputs"]:
        if spec["name"] not in values:
            raise ValueError(f"missing input {spec['name']!r}")
        data, shape = _raw(values[spec["name"]])
        request.inputs.add(name=spec["name"], datatype=spec["datatype"], shape=shape)
        blobs.append(data)
    if region is None:
        request.raw_input_contents.extend(blobs)
        reply = stub.ModelInfer(request, timeout=timeout)
        return {o.name: _tensor(raw, o.datatype, list(o.shape))
                for o, raw in zip(reply.outputs, reply.raw_output_contents, strict=True)}
    return _infer_shm(stub, request, blobs, metadata, region, timeout)


def _infer_shm(stub: Any, request: Any, blobs: list[bytes], metadata: dict[str, Any],
               region: ClientRegion, timeout: float) -> dict[str, Any]:
    from cuvild.engine.arena import align

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
    except grpc.RpcError as e:
        if "unknown shared-memory region" not in (e.details() or ""):
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
