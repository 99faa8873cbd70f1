"""The Open Inference Protocol's system shared memory through tritonclient: inputs and
outputs read and written in place, offsets, mixed with raw contents, errors, whose objects a
caller may use, and nothing left behind. Runs against the session's `env` daemon
(conftest.py); keep the last test last: it stops that daemon.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from daemons import read_text, worker_processes
from oip_helpers import (
    KEY_PREFIX,
    NOBODY,
    SHM_DIR,
    SYSCALLS,
    Served,
    connect_as,
    one_input,
    raw_infer,
    refused,
    rel_error,
    relay,
    shm_input,
    status_of,
)


# -- 4. system shared memory -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "demo"])
def test_infer_shared_memory_inputs(env, triton, regions, name):
    served = env.models[name]
    result = triton.infer(name, [shm_input(served, regions)])
    assert rel_error(result.as_numpy(served.output_name), served.expected) < 1e-4
    status = triton.get_system_shared_memory_status(as_json=True)["regions"]
    assert len(status) == 1


@pytest.mark.parametrize("name", ["mlp", "demo"])
def test_infer_shared_memory_inputs_and_outputs(env, triton, regions, name):
    served = env.models[name]
    inp = shm_input(served, regions)
    out_name, _, out_handle = regions(served.expected.nbytes)
    out = grpcclient.InferRequestedOutput(served.output_name)
    out.set_shared_memory(out_name, served.expected.nbytes)
    result = triton.infer(name, [inp], outputs=[out])
    got = shm.get_contents_as_numpy(out_handle, np.float32, list(served.expected.shape)).copy()
    assert rel_error(got, served.expected) < 1e-4
    meta = result.get_output(served.output_name)
    assert list(meta.shape) == list(served.expected.shape)
    assert meta.parameters["shared_memory_region"].string_param == out_name
    assert len(result.get_response().raw_output_contents) == 0  # nothing raw came back


def test_one_region_with_offsets_for_input_and_output(env, triton, regions):
    """Input at offset 0 and output after it (at an offset) in the same region."""
    served = env.models["mlp"]
    x = served.inputs[0]
    at = x.nbytes + 64
    name, _, handle = regions(at + served.expected.nbytes)
    shm.set_shared_memory_region(handle, [x])
    inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
    inp.set_shared_memory(name, x.nbytes)
    out = grpcclient.InferRequestedOutput(served.output_name)
    out.set_shared_memory(name, served.expected.nbytes, offset=at)
    triton.infer("mlp", [inp], outputs=[out])
    again = shm.get_contents_as_numpy(handle, np.float32, [2, 64]).copy()
    assert np.array_equal(again, x)  # the input was read, not overwritten
    got = shm.get_contents_as_numpy(handle, np.float32, [2, 64], offset=at).copy()
    assert rel_error(got, served.expected) < 1e-4


def test_mixed_shared_memory_and_raw_inputs(env, triton, regions):
    served = env.models["pair"]
    a, b = served.inputs
    name, _, handle = regions(a.nbytes)
    shm.set_shared_memory_region(handle, [a])
    in_a = grpcclient.InferInput(served.input_names[0], list(a.shape), "FP32")
    in_a.set_shared_memory(name, a.nbytes)
    in_b = grpcclient.InferInput(served.input_names[1], list(b.shape), "FP32")
    in_b.set_data_from_numpy(b)
    result = triton.infer("pair", [in_a, in_b])
    assert rel_error(result.as_numpy(served.output_name), served.expected) < 1e-4


def test_mixed_shared_memory_and_raw_outputs(env, triton, regions):
    served = env.models["pair"]
    first, second = served.all_expected
    name, _, handle = regions(first.nbytes)
    out0 = grpcclient.InferRequestedOutput(served.output_names[0])
    out0.set_shared_memory(name, first.nbytes)
    out1 = grpcclient.InferRequestedOutput(served.output_names[1])
    inputs = []
    for in_name, value in zip(served.input_names, served.inputs, strict=True):
        inputs.append(grpcclient.InferInput(in_name, list(value.shape), "FP32"))
        inputs[-1].set_data_from_numpy(value)
    result = triton.infer("pair", inputs, outputs=[out0, out1])
    got = shm.get_contents_as_numpy(handle, np.float32, list(first.shape)).copy()
    assert rel_error(got, first) < 1e-4
    assert rel_error(result.as_numpy(served.output_names[1]), second) < 1e-4


def test_recreated_region_with_the_same_key_is_read_afresh(env, triton):
    """tritonclient's examples reuse fixed keys: register, infer, unregister, destroy, again."""
    served = env.models["mlp"]
    key = f"/{KEY_PREFIX}reused"
    env.keys.append(key)
    for scale in (1.0, 2.0, 3.0):
        x = (served.inputs[0] * scale).astype(np.float32)
        handle = shm.create_shared_memory_region("reused", key, x.nbytes)
        try:
            shm.set_shared_memory_region(handle, [x])
            triton.register_system_shared_memory("reused", key, x.nbytes)
            inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
            inp.set_shared_memory("reused", x.nbytes)
            got = triton.infer("mlp", [inp]).as_numpy(served.output_name)
        finally:
            triton.unregister_system_shared_memory("reused")
            shm.destroy_shared_memory_region(handle)
        expected = raw_infer(triton, Served("mlp", [x], served.expected, served.input_names,
                                            served.output_name))
        assert rel_error(got, expected) < 1e-4, f"scale {scale}: stale region contents"


def test_shared_memory_errors(env, triton, regions):
    served = env.models["mlp"]
    x = served.inputs[0]
    name, key, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])

    def infer_in(region: str, nbytes: int, offset: int = 0) -> Any:
        inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
        inp.set_shared_memory(region, nbytes, offset=offset)
        return triton.infer("mlp", [inp])

    def infer_out(region: str, nbytes: int, offset: int = 0) -> Any:
        out = grpcclient.InferRequestedOutput(served.output_name)
        out.set_shared_memory(region, nbytes, offset=offset)
        return triton.infer("mlp", [one_input(served)], outputs=[out])

    _, spare_key, _ = regions(4096, register=False)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases: list[tuple[str, Callable[[], Any], grpc.StatusCode, list[str]]] = [
        ("unknown input region", lambda: infer_in("no-such-region", x.nbytes),
         invalid, ["unknown shared-memory region", "no-such-region"]),
        ("unknown output region", lambda: infer_out("no-such-region", x.nbytes),
         invalid, ["no-such-region"]),
        ("input past the end", lambda: infer_in(name, x.nbytes, offset=64),
         invalid, [name, "outside"]),
        ("output past the end", lambda: infer_out(name, x.nbytes, offset=4),
         invalid, [name, "outside"]),
        ("input byte size", lambda: infer_in(name, x.nbytes - 4),
         invalid, ["shared_memory_byte_size", str(x.nbytes - 4)]),
        ("output byte size too small", lambda: infer_out(name, x.nbytes - 4),
         invalid, ["shared_memory_byte_size", str(x.nbytes - 4)]),
        ("register twice", lambda: triton.register_system_shared_memory(name, key, x.nbytes),
         grpc.StatusCode.ALREADY_EXISTS, [name, "already registered"]),
        ("no such key", lambda: triton.register_system_shared_memory(
            "ghost", f"/{KEY_PREFIX}ghost", 64), invalid, [f"/{KEY_PREFIX}ghost", "not exist"]),
        ("bad key", lambda: triton.register_system_shared_memory("bad", "/a/b", 64),
         invalid, ["'/a/b'"]),
        ("register past the object", lambda: triton.register_system_shared_memory(
            "big", spare_key, 8192), invalid, ["outside", "4096"]),
        ("register offset past the object", lambda: triton.register_system_shared_memory(
            "off", spare_key, 64, offset=4096 - 32), invalid, ["outside"]),
        ("register zero bytes", lambda: triton.register_system_shared_memory(
            "zero", spare_key, 0), invalid, ["byte_size 0"]),
        ("unregister unknown", lambda: triton.unregister_system_shared_memory("no-such-region"),
         grpc.StatusCode.NOT_FOUND, ["no-such-region"]),
        ("status of unknown", lambda: triton.get_system_shared_memory_status("no-such-region"),
         grpc.StatusCode.NOT_FOUND, ["no-such-region"]),
    ]
    for what, call, code, needles in cases:
        err = refused(call)
        assert status_of(err) == code, (what, err)
        for needle in needles:
            assert needle in err.message(), (what, needle, err.message())
    registered = triton.get_system_shared_memory_status(as_json=True)["regions"]
    assert {r["name"] for r in registered.values()} == {name}  # no failed one stuck
    status = triton.get_system_shared_memory_status(name, as_json=True)["regions"][name]
    assert (status["key"], int(status["byte_size"])) == (key, x.nbytes)
    infer_in(name, x.nbytes)  # the region still works, and so does the daemon
    assert rel_error(raw_infer(triton, served), served.expected) < 1e-4


# -- 6b. whose shared memory: the caller's uid over the unix socket -------------------------
def test_a_replaced_object_is_refused_until_registered_again(env, triton, regions):
    """Workers open a region's object by name; a new object under that name is not the one
    whose owner was checked, so it is refused (Triton keeps mapping the old one)."""
    served = env.models["mlp"]
    x = served.inputs[0]
    name, key, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
    inp.set_shared_memory(name, x.nbytes)
    triton.infer("mlp", [inp])
    (SHM_DIR / key[1:]).unlink()
    fresh = shm.create_shared_memory_region(name + "-new", key, x.nbytes)
    try:
        shm.set_shared_memory_region(fresh, [x])
        err = refused(lambda: triton.infer("mlp", [inp]))
        assert status_of(err) == grpc.StatusCode.INVALID_ARGUMENT
        assert "replaced since it was registered" in err.message()
        triton.unregister_system_shared_memory(name)
        triton.register_system_shared_memory(name, key, x.nbytes)
        got = triton.infer("mlp", [inp]).as_numpy(served.output_name)
        assert rel_error(got, served.expected) < 1e-4
    finally:
        shm.destroy_shared_memory_region(fresh)


@pytest.mark.parametrize("model", ["mlp", "demo"])  # one part; two parts on two workers
def test_workers_unmap_a_region_once_it_is_unregistered(env, triton, regions, model):
    """An unlinked object lives as long as somebody maps it: unregistering must unmap it in
    the workers too, or a client could pin /dev/shm memory through cuvild."""
    served = env.models[model]
    x = served.inputs[0]
    name, key, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
    inp.set_shared_memory(name, x.nbytes)
    triton.infer(model, [inp])
    workers = worker_processes(env.daemon.proc.pid)

    def mapped() -> list[str]:
        return [w.name for w in workers if f"/dev/shm/{key[1:]}" in read_text(w / "maps")]

    assert mapped(), "a worker should map the region it read"
    triton.unregister_system_shared_memory(name)
    raw_infer(triton, served)  # OpenVINO lets go of its last input on its next run
    deadline = time.monotonic() + 10
    while mapped():
        assert time.monotonic() < deadline, f"still mapped by workers {mapped()}"
        time.sleep(0.1)


@pytest.mark.skipif(os.getuid() != 0 or os.uname().machine not in SYSCALLS,
                    reason="needs root on x86-64 or aarch64 to connect as another user")
def test_another_user_cannot_use_objects_or_regions_it_does_not_own(env, triton, regions,
                                                                    tmp_path):
    """Over the unix socket the caller's uid comes from SO_PEERCRED: a client connected as
    `nobody` may not register root's object nor name root's region, but may use its own."""
    served = env.models["mlp"]
    x = served.inputs[0]
    root_region, root_key, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    socket_path = env.daemon.target.removeprefix("unix:")
    os.chmod(socket_path, 0o666)  # let `nobody` connect, for this test only
    try:
        conn = connect_as(NOBODY, socket_path)
    finally:
        os.chmod(socket_path, 0o660)
    other = grpcclient.InferenceServerClient(url=relay(conn, tmp_path))
    mine_name, mine_key, mine = regions(x.nbytes, register=False)
    os.chown(SHM_DIR / mine_key[1:], NOBODY, NOBODY)
    shm.set_shared_memory_region(mine, [x])
    try:
        err = refused(lambda: other.register_system_shared_memory("t", root_key, x.nbytes))
        assert status_of(err) == grpc.StatusCode.PERMISSION_DENIED
        assert f"owned by uid 0, not by the caller (uid {NOBODY})" in err.message()
        inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
        inp.set_shared_memory(root_region, x.nbytes)
        err = refused(lambda: other.infer("mlp", [inp]))
        assert status_of(err) == grpc.StatusCode.INVALID_ARGUMENT
        assert f"unknown shared-memory region {root_region!r}" in err.message()
        assert other.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
        other.register_system_shared_memory(mine_name, mine_key, x.nbytes)
        inp.set_shared_memory(mine_name, x.nbytes)
        got = other.infer("mlp", [inp]).as_numpy(served.output_name)
        assert rel_error(got, served.expected) < 1e-4
        # ...and root's own view is untouched by nobody's region of the same name.
        assert root_region in triton.get_system_shared_memory_status(as_json=True)["regions"]
        other.unregister_system_shared_memory(mine_name)
    finally:
        other.close()


# -- 7. shared memory left behind (keep last: it stops the module's daemon) ------------------
def test_stopped_daemon_leaves_no_shared_memory(env, triton):
    served = env.models["demo"]
    raw_infer(triton, served)  # the arena exists even when this test runs alone
    pid = env.daemon.proc.pid
    arena = sorted(p.name for p in SHM_DIR.glob(f"cuvil-{pid}-*"))
    assert arena, "the daemon's arena should be in /dev/shm while it serves"
    triton.unregister_system_shared_memory()  # all
    assert env.daemon.stop() == 0
    assert sorted(p.name for p in SHM_DIR.glob(f"cuvil-{pid}-*")) == []
    assert [k for k in env.keys if (SHM_DIR / k.lstrip("/")).exists()] == []
    assert list(SHM_DIR.glob(f"{KEY_PREFIX}*")) == []
    assert shm.mapped_shared_memory_regions() == []
