"""cuvild: the daemon process.

Start-up, in order: read and validate the config (exit 2 on a bad one), get the device
profiles (cached by hardware fingerprint, else measured), start gRPC with the health and
reflection services on a private socket, bind the public unix socket (mode 0660; a stale
socket from a crashed run is replaced, a live one is an error) through the front that reads
each caller's uid (cuvild/serve/front.py), tell systemd READY=1. SIGTERM/SIGINT drain and exit 0,
removing the socket; SIGHUP reloads the config.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import socket
import stat
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

# No child of the daemon uses its gRPC (the forkserver and the resource tracker start
# afresh): without fork support gRPC installs no fork handlers, and so prints no "skipping
# fork() handlers" line each time the daemon starts one. Read when gRPC loads: set first.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import cuvild
from cuvild import config as config_mod
from cuvild.core.arena import Arena, reclaim_stale
from cuvild.intake.registry import Registry
from cuvild.intake.verdicts import Verdicts
from cuvild.serve import sdnotify
from cuvild.serve.control import ControlService
from cuvild.serve.front import Front
from cuvild.serve.limits import Gate, Uploads, quiet_grpc_logs, raise_nofile
from cuvild.workers.worker import LOG_LEVEL_ENV, OMP_WAIT_ENV, shares_cores
from protos import cuvil_pb2, cuvil_pb2_grpc, inference_pb2, inference_pb2_grpc
from runtimes import crashes
from runtimes.cache import KEY_ENV, cache_key_file, keep_inductor_headers
from runtimes.profiling import measure as profiles_mod

if TYPE_CHECKING:
    from cuvild.engine.engine import Engine
    from cuvild.run.runner import Runner

log = logging.getLogger("cuvild")
STARTED = time.monotonic()
DRAIN_GRACE_S = 5.0
CONTROL_SERVICE = cuvil_pb2.DESCRIPTOR.services_by_name["Control"].full_name
INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


def reflection_pool() -> Any:
    """One descriptor pool with every service we serve: inference_pb2 lives in a private pool
    (see the Makefile), so the default pool alone cannot describe it."""
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.DescriptorPool()
    for module in (cuvil_pb2, inference_pb2, health_pb2, reflection_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return pool


class StartupError(RuntimeError):
    """The daemon cannot start for a reason outside its config (exit 1)."""


def prepare_socket(path: str) -> None:
    """Make `path` free for bind: remove a stale socket, refuse a live one or a non-socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s left by an earlier run", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise StartupError(f"another cuvild is already serving on {path}")


class Reloads:
    """Reloads asked for (SIGHUP, `systemctl reload`, the Reload call of `cuvilctl reload`),
    run one at a time on the daemon's main thread; a caller may wait for the outcome."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._waiting: list[futures.Future[dict[str, Any]]] = []

    def request(self) -> futures.Future[dict[str, Any]]:
        future: futures.Future[dict[str, Any]] = futures.Future()
        with self._lock:
            self._waiting.append(future)
        self.event.set()
        return future

    def take(self) -> list[futures.Future[dict[str, Any]]]:
        """The callers the next reload answers (asked before it starts)."""
        with self._lock:
            self.event.clear()
            waiting, self._waiting = self._waiting, []
        return waiting


class Daemon:
    def __init__(self, cfg: config_mod.Config, repository: str | None = None) -> None:
        """`repository`: `--model-repository`, over the config's (kept across reloads)."""
        self.cfg = cfg
        self.repository_flag = repository
        if repository:
            cfg.model_repository = repository
        self.stop_event = threading.Event()
        self.reloads = Reloads()
        self.alive = threading.Event()
        self.profiles: profiles_mod.ProfileResult | None = None
        self.health = health.HealthServicer()
        self.servers: list[grpc.Server] = []
        self.registry: Registry | None = None
        self.engine: Engine | None = None  # made once profiles are known
        self.models: Any = None  # cuvild.load.models.ModelManager, with the engine
        self.regions: Any = None
        self.cuda_regions: Any = None  # the cuda_shared_memory extension's
        self.arena: Arena | None = None
        self._faults: IO[str] | None = None  # faulthandler's file (runtimes/crashes.py)
        self.front: Front | None = None
        self.fast: Any = None  # cuvild.serve.fast.FastPath, when shm.fast_path
        self.metrics: Any = None  # cuvild.serve.metrics.Metrics, when metrics.enabled
        self.tracer: Any = None  # cuvild.serve.tracing.Tracer, when tracing.exporter is set
        self.uploads: Uploads | None = None  # one count of uploads for every listener
        self.http: Any = None  # cuvild.serve.rest.RestServer, when listen.http

    # -- profiles --------------------------------------------------------------------------
    def _load_profiles(self, refresh: bool = False) -> profiles_mod.ProfileResult:
        result = profiles_mod.load_or_measure(
            self.cfg.state_dir, self.cfg.device_settings(), self.cfg.overrides, refresh=refresh)
        self.profiles = result
        how = {"measured": "measured", "cache": "read from the profile cache"}.get(
            result.source, result.source)
        log.info("%d device(s) %s in %.2f s: %s", len(result.devices), how, result.seconds,
                 ", ".join(d.id + (" (emulated)" if d.emulated else "") for d in result.devices))
        return result

    def current_profiles(self) -> profiles_mod.ProfileResult:
        assert self.profiles is not None
        return self.profiles

    # -- server ----------------------------------------------------------------------------
    def _bind_unix(self, server: grpc.Server) -> None:
        # gRPC serves a private socket; the front owns the public one (cuvild/serve/front.py).
        prepare_socket(self.cfg.unix_socket)
        assert self.front is not None
        if server.add_insecure_port(f"unix:{self.front.inner_path}") == 0:
            raise StartupError(f"cannot bind unix socket {self.front.inner_path}")

    def _build_server(self, tcp: bool) -> grpc.Server:
        from cuvild.serve.auth import TokenAuth
        from cuvild.serve.oip import InferenceService

        interceptors = [TokenAuth(self.cfg.token)] if tcp and self.cfg.token else []
        gate = Gate(self.cfg.rpc_threads)  # per listener: each server has its own threads
        idle_ms = int(self.cfg.idle_timeout_s * 1000)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.cfg.rpc_threads,
                                                        thread_name_prefix="rpc"),
                             interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", 256 << 20),
                                      ("grpc.max_send_message_length", 256 << 20),
                                      # Idle connections get a GOAWAY (clients reconnect
                                      # cleanly); silent ones are dropped after the handshake.
                                      ("grpc.max_connection_idle_ms", idle_ms),
                                      ("grpc.server_handshake_timeout_ms", idle_ms)])
        control = ControlService(self.current_profiles, lambda: self._load_profiles(True),
                                 self.cfg.path, self.registry, self.uploads, gate,
                                 self.models, self.metrics, reload=self.reloads.request,
                                 generator=self.generator)
        shm = not tcp or self.cfg.shm_allow_tcp_clients
        peer_uid = self.front.caller if not tcp and self.front else (lambda peer: None)
        cuvil_pb2_grpc.add_ControlServicer_to_server(control, server)
        inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceService(self.models, self.engine.runner, self.regions, shm_enabled=shm,
                             peer_uid=peer_uid, metrics=self.metrics, tracer=self.tracer,
                             gate=gate, cuda=self.cuda_regions, generator=self.generator),
            server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (CONTROL_SERVICE, INFERENCE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
            server, pool=reflection_pool())
        if tcp:
            creds = self._tls_credentials()
            bound = (server.add_secure_port(self.cfg.tcp, creds) if creds
                     else server.add_insecure_port(self.cfg.tcp))
            if bound == 0:
                raise StartupError(f"cannot listen on TCP {self.cfg.tcp} (listen.tcp)")
        else:
            self._bind_unix(server)
        return server

    def _start_http(self) -> None:
        """listen.http: the protocol over HTTP/REST, through the same servicer as gRPC's."""
        if not self.cfg.http:
            return
        from cuvild.serve.oip import InferenceService
        from cuvild.serve.rest import RestServer, tls_context

        # system shared memory under the TCP listener's rule (caller None: shm.allowed_uids)
        service = InferenceService(self.models, self.engine.runner, self.regions,
                                   shm_enabled=self.cfg.shm_allow_tcp_clients,
                                   metrics=self.metrics, tracer=self.tracer,
                                   gate=Gate(self.cfg.rpc_threads), cuda=self.cuda_regions)
        http = RestServer(service, self.cfg.http, self.cfg.rpc_threads, self.cfg.token,
                          tls_context(self.cfg.tls_cert, self.cfg.tls_key,
                                      self.cfg.tls_client_ca), drain_s=DRAIN_GRACE_S,
                          metrics=self.metrics, limits=self.cfg.http_limits,
                          generator=self.generator)
        try:
            http.start()
        except OSError as e:
            http.stop()
            raise StartupError(f"cannot listen on HTTP {self.cfg.http} (listen.http): {e}") \
                from None
        self.http = http

    def _tls_credentials(self) -> grpc.ServerCredentials | None:
        if not self.cfg.tls_cert:
            return None
        key = Path(self.cfg.tls_key).read_bytes()
        cert = Path(self.cfg.tls_cert).read_bytes()
        ca = Path(self.cfg.tls_client_ca).read_bytes() if self.cfg.tls_client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def _start_engine(self) -> None:
        from cuvild.core.loaded import Batching
        from cuvild.engine.engine import Engine
        from cuvild.load import warm
        from cuvild.load.models import ModelManager
        from cuvild.serve.cuda_regions import CudaRegions
        from cuvild.serve.regions import Regions

        for name in reclaim_stale():
            log.info("reclaimed shared memory %s left by a stopped daemon", name)
        warm.clean(self.cfg.cache_dir)  # what a crash mid-write left of load records
        for fault in crashes.left_by_the_dead(self.cfg.cache_dir):  # (thread workers' faults)
            log.warning("the daemon before (pid %d) died: %s%s", fault.pid, fault.said,
                        f"; compiling {', '.join(fault.compiles)}: not tried again"
                        if fault.compiles else "")
        self._faults = crashes.watch(self.cfg.cache_dir)
        self.arena = Arena(str(os.getpid()))
        profiles = self.current_profiles()
        self.engine = engine = Engine(profiles.devices, self.cfg.cache_dir, self.arena,
                        max_in_flight=self.cfg.max_in_flight,
                        run_timeout_s=self.cfg.run_timeout_s, max_buckets=self.cfg.max_buckets,
                        max_dim=self.cfg.max_dim, runtimes=self.cfg.runtimes,
                        max_sequences=self.cfg.max_sequences,
                        sequence_idle_s=self.cfg.sequence_idle_s,
                        prefix_cache_bytes=self.cfg.prefix_cache_mib << 20,
                        workers=self.cfg.workers,
                        build_timeout_s=config_mod.build_timeout_s(self.cfg),
                        compile_timeout_s=self.cfg.compile_timeout_s,
                        corrections_path=self.cfg.state_dir / "corrections"
                        / f"{profiles.fingerprint}.json")
        self.models = ModelManager(self.registry, engine.builder, self.cfg.objective,
                                   self.cfg.precision, self.cfg.max_error,
                                   Batching(self.cfg.max_batch, self.cfg.max_delay_us),
                                   warm_up=self.cfg.warm_up)
        started = self.models.start_workers()
        if started:
            log.debug("workers for %s starting (named by load records)", ", ".join(started))
        self.regions = Regions(self.cfg.shm_allowed_uids, self.cfg.shm_max_regions,
                               self.cfg.shm_max_bytes)
        cuda = {int(d.id[3:]) for d in profiles.devices  # the CUDA GPUs served: gpu0 -> 0
                if d.kind == "gpu" and not d.emulated and d.id[3:].isdecimal()}
        self.cuda_regions = CudaRegions(self.cfg.shm_max_regions, self.cfg.shm_max_bytes, cuda,
                                        direct=self.cfg.workers == "process")
        from cuvild.serve.generation import Generator

        self.generator = Generator(self.models, engine.runner, self.cfg.model_repository)
        if self.cfg.fast_path:
            from cuvild.serve.fast import FastPath

            self.fast = FastPath(self.models, engine.runner)
        self._observe(engine.runner)

    def _caller_gone(self, uid: int) -> None:
        """A uid's last unix connection closed: its regions go (and the workers' mappings)."""
        gone = self.regions.unregister(uid)
        # closes their IPC handles, and has the workers close theirs
        self.engine.builder.forget_segments([(r.object_name, 0)
                                             for r in self.cuda_regions.unregister(uid)])
        if gone:
            log.info("uid %d disconnected: dropped its %d shared-memory region(s)", uid,
                     len(gone))
            self.engine.builder.forget_segments([(r.object_name, r.inode) for r in gone])

    def _observe(self, runner: Runner) -> None:
        """Metrics (and their endpoint) and traces, as the config asks."""
        cfg = self.cfg
        if cfg.metrics_enabled:
            from cuvild.serve.metrics import Metrics

            self.metrics = Metrics()
            self.metrics.watch(self.models, runner, self.regions, self.fast)
            if self.fast is not None:
                self.fast.metrics = self.metrics
            self.generator.metrics = self.metrics
            runner.monitor = self.metrics
            if cfg.metrics_listen:
                try:
                    log.info("metrics on %s", self.metrics.serve(cfg.metrics_listen,
                                                                 cfg.http_limits))
                except OSError as e:
                    raise StartupError(f"cannot serve metrics on {cfg.metrics_listen} "
                                       f"(metrics.listen): {e}") from None
        if cfg.tracing_exporter:
            from cuvild.serve.tracing import Tracer

            self.tracer = Tracer(cfg.tracing_exporter, cfg.tracing_path, cfg.tracing_endpoint,
                                 cfg.tracing_sample_rate)
            log.info("tracing %.0f%% of requests to %s", 100 * cfg.tracing_sample_rate,
                     cfg.tracing_path or cfg.tracing_endpoint)

    def _reload(self) -> dict[str, Any]:
        """Read the config file again; what happened, for a caller that asked (Reload)."""
        try:
            new = config_mod.load(self.cfg.path)
        except config_mod.ConfigError as e:
            log.error("reload: keeping the running config, %s is invalid: %s", self.cfg.path, e)
            sdnotify.notify(f"STATUS=reload failed: {e}")
            return {"ok": False, "error": str(e), "config_path": str(self.cfg.path)}
        later = sorted({key for name, key in config_mod.ON_RESTART.items()
                        if getattr(new, name) != getattr(self.cfg, name)})
        if later:
            log.warning("reload: %s take(s) effect on restart", ", ".join(later))
        for name in config_mod.ON_RESTART:  # the config held is the one that runs
            setattr(new, name, getattr(self.cfg, name))
        if self.repository_flag:
            new.model_repository = self.repository_flag
        self._apply(new)
        self.cfg = new
        self._read_repository()  # new and changed entries are registered and served
        self._load_profiles()
        log.info("reloaded %s", new.path)
        sdnotify.notify("STATUS=serving (config reloaded)")
        return {"ok": True, "config_path": str(new.path), "on_restart": later}

    def _apply(self, new: config_mod.Config) -> None:
        """The settings a reload changes (config.RELOADED), set where they are read."""
        logging.getLogger().setLevel(new.log_level.upper())
        if self.engine is not None:  # (the workers' too)
            self.engine.workers.set_log_level(new.log_level)
        if self.registry is not None:
            self.registry.max_model_bytes = new.max_model_bytes
        if self.uploads is not None:
            self.uploads.idle_s, self.uploads.max_s = new.upload_idle_s, new.upload_max_s
        if self.regions is not None:  # for the next registration
            self.regions.max_regions, self.regions.max_bytes = (new.shm_max_regions,
                                                                new.shm_max_bytes)
            self.regions.tcp_owners = set(new.shm_allowed_uids)
            self.cuda_regions.max_regions, self.cuda_regions.max_bytes = (new.shm_max_regions,
                                                                          new.shm_max_bytes)
        if self.models is not None:  # for the next request, build or load
            from cuvild.core.loaded import Batching
            from cuvild.core.precision import PrecisionPolicy

            runner, builder = self.engine.runner, self.engine.builder
            runner.run_timeout_s, runner.max_dim = new.run_timeout_s, new.max_dim
            self.engine.buckets.max_buckets = max(1, new.max_buckets)
            builder.runtimes, builder.compile_timeout_s = new.runtimes, new.compile_timeout_s
            builder.build_timeout_s = config_mod.build_timeout_s(new)
            self.models.objective = new.objective
            self.models.default_policy = PrecisionPolicy(new.precision, new.max_error)
            self.models.default_batching = Batching(new.max_batch, new.max_delay_us)

    def run(self) -> int:  # noqa: C901, PLR0915 - start-up in order, as docs/OPERATIONS.md lists it
        soft, _ = raise_nofile()
        # the compile cache's signing key: workers inherit where it is (runtimes/cache.py);
        # an operator's (a Secret shared by pods) wins over state_dir's own
        os.environ.setdefault(KEY_ENV, str(self.cfg.state_dir / "cache.key"))
        # the workers' CUDA graphs (runtimes/graphs.py), inherited by every worker
        os.environ["CUVILD_CUDA_GRAPHS"] = "1" if self.cfg.cuda_graphs else "0"
        os.environ[LOG_LEVEL_ENV] = self.cfg.log_level  # (the workers' log, from their start)
        # and their language models' compiled decode steps (runtimes/compiled_step.py)
        os.environ["CUVILD_COMPILE_STEPS"] = "1" if self.cfg.compile_steps else "0"
        # and whether their prompt chunks may run mixed (cuvild/load/precision.py)
        os.environ["CUVILD_MIXED_PROMPT"] = "1" if self.cfg.mixed_prompt else "0"
        # inductor's and Triton's own caches under cuvild's (an operator's setting wins), set
        # before torch is imported here: inductor fixes its directory in the environment at
        # its first use, which the forkserver's preload makes (/tmp/torchinductor_<user>,
        # that a systemd PrivateTmp empties at every restart), and its workers inherit it
        for env, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
            os.environ.setdefault(env, str(Path(self.cfg.cache_dir) / sub))
        cache_key_file()  # made now (0600), not by two workers at once
        quiet_grpc_logs()
        log.debug("open-file limit %d", soft)
        self.uploads = Uploads(self.cfg.max_concurrent_uploads, self.cfg.upload_idle_s,
                               self.cfg.upload_max_s)
        sdnotify.notify("STATUS=profiling devices")
        self._load_profiles()
        # OpenMP's waits in the workers (and the forkserver they fork from): by whether two
        # devices share cores (cuvild/workers/worker.py); before any of them imports torch
        wait = self.cfg.omp_wait
        if wait == "auto":
            wait = "passive" if shares_cores(self.current_profiles().devices) else "spin"
        os.environ[OMP_WAIT_ENV] = wait
        self.registry = Registry(self.cfg.state_dir, self.cfg.max_model_bytes,
                                 Verdicts(self.cfg.cache_dir))
        self._start_engine()
        try:
            self.front = Front(self.cfg.unix_socket, self.cfg.max_connections,
                               self.cfg.max_connections_per_uid, on_last_close=self._caller_gone,
                               on_session=self.fast.accept if self.fast else None,
                               scratch_base=str(Path(self.cfg.cache_dir) / "scratch"))
        except OSError as e:
            self.engine.close()
            self.arena.close()
            raise StartupError(f"cannot make the private or scratch directory: {e}") from None
        # multiprocessing's temporary directory (the forkserver's listening socket) inside
        # the private one, before the forkserver starts: a killed daemon left /tmp/pymp-*
        # behind, which nothing removed; this one goes with the private directory
        multiprocessing.process.current_process()._config["tempdir"] = (  # noqa: SLF001
            self.front.private_dir)
        # and the workers' temporary files (an ONNX export, IREE's module), on disk: they
        # exit without finalizers, and left /tmp/cuvil-ort-* (a part's weights) at each stop
        os.environ["TMPDIR"] = self.front.scratch_dir
        keep_inductor_headers(self.front.scratch_dir)  # (not rebuilt at every start)
        try:
            self.servers = [self._build_server(tcp=False)]
            if self.cfg.tcp:
                self.servers.append(self._build_server(tcp=True))
            for server in self.servers:
                server.start()
            self._start_http()
            # Registered models are LOADING before the first connection: a client that comes
            # back after a restart waits for its model rather than hearing it is unknown.
            self.models.restore()
            self._read_repository()
            self.front.start()
        except BaseException:
            self.front.close()
            if self.http is not None:
                self.http.stop()
            for server in self.servers:
                server.stop(None)
            self.engine.close()
            self.arena.close()
            raise
        if self.cfg.tcp:
            auth = [a for a, on in (("TLS", self.cfg.tls_cert), ("mutual TLS",
                    self.cfg.tls_client_ca), ("bearer token", self.cfg.token)) if on]
            log.info("also listening on TCP %s (%s)", self.cfg.tcp,
                     ", ".join(auth) or "insecure loopback")
        for name in ("", CONTROL_SERVICE, INFERENCE_SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.alive.set()
        ready_s = time.monotonic() - STARTED
        log.info("cuvild %s ready in %.2f s on unix:%s", cuvild.__version__, ready_s,
                 self.cfg.unix_socket)
        sdnotify.notify(f"READY=1\nSTATUS=serving on unix:{self.cfg.unix_socket}\n"
                        f"MAINPID={os.getpid()}")
        sdnotify.start_watchdog(self.alive, self.stop_event)
        swept = time.monotonic()
        while not self.stop_event.is_set():
            if self.reloads.event.wait(timeout=0.2):
                waiting = self.reloads.take()
                sdnotify.notify("RELOADING=1")
                outcome = self._reload()
                sdnotify.notify("READY=1")
                for future in waiting:
                    future.set_result(outcome)
            idle_s = self.cfg.idle_timeout_s  # fast-path sessions idle that long end
            if self.fast and time.monotonic() - swept >= min(1.0, idle_s / 4):
                try:
                    self.fast.sweep(idle_s)
                except Exception:  # a bug: said, and the daemon goes on serving
                    log.exception("fast path: the idle sweep failed")
                swept = time.monotonic()
        return self._shutdown()

    def _read_repository(self) -> None:
        """Register and serve the model repository's entries on a thread of its own (at start
        and on SIGHUP): the daemon answers meanwhile, not ready until they are all READY or
        failed (cuvild/intake/repository.py)."""
        if not self.cfg.model_repository:
            return
        from cuvild.intake.summary import inspect_archive

        models, registry = self.models, self.registry
        models.scan_asked()  # before the thread runs: ServerReady is false from now
        threading.Thread(target=models.load_repository, name="repository", daemon=True,
                         args=(Path(self.cfg.model_repository),
                               lambda path: inspect_archive(path, registry.max_model_bytes)),
                         ).start()

    def _shutdown(self) -> int:  # noqa: C901 - each listener and service, closed in order
        sdnotify.notify("STOPPING=1\nSTATUS=draining")
        log.info("stopping: draining requests (up to %.0f s)", DRAIN_GRACE_S)
        self.health.enter_graceful_shutdown()
        if self.front is not None:
            self.front.stop_accepting()
        stops = [server.stop(grace=DRAIN_GRACE_S) for server in self.servers]
        if self.http is not None:
            self.http.stop()
        for stopped in stops:
            stopped.wait()
        if self.fast is not None:  # after gRPC's drain: the sessions' last runs finish
            self.fast.close()
        if self.front is not None:
            self.front.close()
        if self.models is not None:
            self.models.close()
            self.engine.close()
        if self.regions is not None:
            self.regions.close()
        if self.cuda_regions is not None:
            self.cuda_regions.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.tracer is not None:
            self.tracer.close()  # exports what is still batched
        if self.arena is not None:
            self.arena.close()
        if self._faults is not None:
            crashes.unwatch(self._faults)
        log.info("stopped")
        return 0

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGHUP, lambda *_: self.reloads.event.set())


def default_config_path() -> str | None:
    path = os.environ.get("CUVILD_CONFIG")
    if path:
        return path
    return "/etc/cuvild/cuvild.yaml" if Path("/etc/cuvild/cuvild.yaml").exists() else None


def entry() -> None:
    """The `cuvild` command: main(), then out without the interpreter's teardown."""
    from cuvild.workers.quick_exit import quick_exit

    quick_exit(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cuvild", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=default_config_path(),
                        help="YAML config (default: $CUVILD_CONFIG, /etc/cuvild/cuvild.yaml, "
                             "else built-in defaults)")
    parser.add_argument("--model-repository", metavar="DIR",
                        help="serve DIR/<name>/<version>/model.pt2 from the start (over the "
                             "config's model_repository)")
    parser.add_argument("--version", action="version", version=f"cuvild {cuvild.__version__}")
    args = parser.parse_args(argv)
    try:
        cfg = config_mod.load(args.config) if args.config else config_mod.parse({}, "<defaults>")
        repository = args.model_repository and config_mod.repository_dir(args.model_repository)
    except config_mod.ConfigError as e:
        print(f"cuvild: bad config {args.config or '<defaults>'}: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    daemon = Daemon(cfg, repository)
    daemon.install_signals()
    try:
        return daemon.run()
    except (StartupError, profiles_mod.ProfilingError) as e:
        log.error("%s", e)
        sdnotify.notify(f"STATUS=failed: {e}")
        return 1
