"""The TCP listener: bearer token, TLS and mutual TLS; client shared memory off on TCP."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from daemons import free_port

from protos import cuvil_pb2, cuvil_pb2_grpc, inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="needs the openssl command to make test certificates")
TOKEN = "s3cret-token"


def make_certs(d: Path) -> dict[str, Path]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=cuvil-test-ca")
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", "ext.cnf")
    return {n: d / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def status(channel: grpc.Channel, token: str | None = None) -> str:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    stub = cuvil_pb2_grpc.ControlStub(channel)
    return stub.GetStatus(cuvil_pb2.GetStatusRequest(), timeout=10, metadata=metadata).version


def test_tls_with_token(make_daemon, tmp_path):
    certs = make_certs(tmp_path)
    port = free_port()
    make_daemon(listen={"tcp": f"127.0.0.1:{port}", "token": TOKEN,
                        "tls": {"cert": str(certs["server.pem"]),
                                "key": str(certs["server.key"])}})
    creds = grpc.ssl_channel_credentials(root_certificates=certs["ca.pem"].read_bytes())
    with grpc.secure_channel(f"localhost:{port}", creds) as channel:
        assert status(channel, TOKEN)
        with pytest.raises(grpc.RpcError) as err:
            status(channel)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            status(channel, "wrong")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:  # client shared memory is off over TCP
            stub.SystemSharedMemoryRegister(
                inference_pb2.SystemSharedMemoryRegisterRequest(name="r", key="/r", byte_size=8),
                timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")])
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with grpc.insecure_channel(f"127.0.0.1:{port}") as plain, pytest.raises(grpc.RpcError):
        status(plain, TOKEN)


def test_mutual_tls_without_token(make_daemon, tmp_path):
    certs = make_certs(tmp_path)
    port = free_port()
    make_daemon(listen={"tcp": f"127.0.0.1:{port}",
                        "tls": {"cert": str(certs["server.pem"]), "key": str(certs["server.key"]),
                                "client_ca": str(certs["ca.pem"])}})
    ca = certs["ca.pem"].read_bytes()
    mine = grpc.ssl_channel_credentials(ca, certs["client.key"].read_bytes(),
                                        certs["client.pem"].read_bytes())
    with grpc.secure_channel(f"localhost:{port}", mine) as channel:
        assert status(channel)
    anonymous = grpc.ssl_channel_credentials(ca)
    with grpc.secure_channel(f"localhost:{port}", anonymous) as channel:
        with pytest.raises(grpc.RpcError) as err:
            status(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake is refused


def test_tcp_shared_memory_only_for_allowed_owners_and_never_the_arena(make_daemon, tmp_path):
    """With shm.allow_tcp_clients, a TCP caller (no uid) may register objects owned by
    shm.allowed_uids, and never cuvild's arena; unix callers' regions stay invisible to it."""
    import os
    import uuid

    port = free_port()
    key = f"/cuvil-tcptest-{uuid.uuid4().hex[:8]}"
    shm_path = Path("/dev/shm") / key[1:]
    shm_path.write_bytes(b"\0" * 4096)
    shm_path.chmod(0o600)  # private to its owner: cuvild refuses objects others can reach
    try:
        d = make_daemon(listen={"tcp": f"127.0.0.1:{port}", "insecure_loopback": True},
                        shm={"allow_tcp_clients": True, "allowed_uids": [os.getuid()]})
        with grpc.insecure_channel(f"127.0.0.1:{port}") as tcp, \
                grpc.insecure_channel(d.target) as unix:
            over_tcp = inference_pb2_grpc.GRPCInferenceServiceStub(tcp)
            over_unix = inference_pb2_grpc.GRPCInferenceServiceStub(unix)
            over_unix.SystemSharedMemoryRegister(inference_pb2.SystemSharedMemoryRegisterRequest(
                name="mine", key=key, byte_size=4096), timeout=10)
            over_tcp.SystemSharedMemoryRegister(inference_pb2.SystemSharedMemoryRegisterRequest(
                name="tcp", key=key, byte_size=4096), timeout=10)
            regions = over_tcp.SystemSharedMemoryStatus(
                inference_pb2.SystemSharedMemoryStatusRequest(), timeout=10).regions
            assert set(regions) == {"tcp"}  # not the unix caller's "mine"
            with pytest.raises(grpc.RpcError) as err:  # the name alone is refused
                over_tcp.SystemSharedMemoryRegister(
                    inference_pb2.SystemSharedMemoryRegisterRequest(
                        name="arena", key=f"/cuvil-{d.proc.pid}-0", byte_size=64), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "cuvild's own memory" in err.value.details()
    finally:
        shm_path.unlink(missing_ok=True)
