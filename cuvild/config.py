"""cuvild.yaml: load, fill defaults, validate every key.

A bad config is the most common way a daemon fails to start, so every error names the key
(as a dotted path) and what was expected; `cuvild` exits 2 on it.

Paths left empty follow systemd when it runs us (RUNTIME_DIRECTORY, STATE_DIRECTORY,
CACHE_DIRECTORY) and the XDG directories otherwise, so one config serves both `make run`
and the systemd unit.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config key is missing, unknown or has a bad value."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass
class EmulatedDevice:
    id: str
    kind: str
    runtime: str
    cores: list[int]


@dataclass(frozen=True)
class HttpLimits:
    """limits.http: what one HTTP listener (listen.http, and metrics.listen) lets a client
    hold. Every field is a key of the file, with this default (docs/OPERATIONS.md)."""

    max_body_bytes: int = 64 << 20  # a request's body; 413 past it (Triton: 64 MB)
    max_json_bytes: int = 8 << 20  # its JSON part (tensors in JSON cost ~10x their bytes)
    bodies_at_once: int = 4  # bodies read and parsed at once; the rest wait their turn
    max_connections: int = 256  # open at once; past it a connection gets a 503 and closes
    header_timeout_s: float = 10.0  # a request's line and headers arrive within this
    body_timeout_s: float = 60.0  # and its body within this (408 past it)
    keepalive_s: float = 75.0  # an idle connection between requests is closed after this


@dataclass
class Config:
    path: str
    unix_socket: str
    tcp: str | None
    state_dir: Path
    cache_dir: Path
    log_level: str
    cpu_enabled: bool
    cpu_cores: list[int] | None
    gpu_enabled: bool
    openvino_enabled: bool
    emulated: list[EmulatedDevice] = field(default_factory=list)
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_model_bytes: int = 2 << 30
    max_concurrent_uploads: int = 2
    upload_idle_s: float = 30.0  # an upload stream silent this long is cancelled
    upload_max_s: float = 3600.0  # and one still going after this
    max_connections: int = 256  # unix connections relayed at once, all users
    max_connections_per_uid: int = 64
    idle_timeout_s: float = 600.0  # a unix connection with no traffic is closed
    rpc_threads: int = 32  # gRPC handler threads per listener (4 kept for quick calls)
    shm_max_regions: int = 64  # per caller
    shm_max_bytes: int = 16 << 30  # per caller, summed over its regions
    run_timeout_s: float = 60.0  # a request's deadline when its caller gives none
    max_buckets: int = 8  # built input shapes kept per dynamic-shape model
    max_dim: int = 4096  # largest size accepted for a dynamic dimension
    # device id or kind -> the runtimes `auto` may try there ({}: every one)
    runtimes: dict[str, list[str]] = field(default_factory=dict)
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    insecure_loopback: bool = False
    shm_allowed_uids: list[int] = field(default_factory=list)
    shm_allow_tcp_clients: bool = False
    fast_path: bool = True  # same-host sessions on the unix socket (cuvild/serve/fast.py)
    max_in_flight: int = 4
    objective: str = "latency"
    compile_timeout_s: float = 300.0
    workers: str = "process"
    precision: str = "fp32"  # the precision policy of a model loaded without one
    max_error: float = 0.01  # the error budget of "auto" when a load gives none
    # dynamic batching of models whose first dimension is dynamic (max_batch 1: off)
    max_batch: int = 8
    max_delay_us: int = 500
    metrics_enabled: bool = True
    metrics_listen: str | None = None  # HOST:PORT of /metrics (None: no endpoint)
    tracing_exporter: str | None = None  # "file" | "otlp" | None (off)
    tracing_path: str | None = None
    tracing_endpoint: str | None = None
    tracing_sample_rate: float = 1.0
    http: str | None = None  # HOST:PORT of the protocol's HTTP/REST form (None: off)
    model_repository: str | None = None  # DIR/<name>/<version>/model.pt2, loaded at start
    http_limits: HttpLimits = field(default_factory=HttpLimits)  # limits.http

    def device_settings(self) -> dict[str, Any]:
        """The settings that change what the profiler measures (part of the cache key)."""
        return {
            "cpu": {"enabled": self.cpu_enabled, "cores": self.cpu_cores},
            "gpu": self.gpu_enabled,
            "openvino": self.openvino_enabled,
            "emulated": [vars(e) for e in self.emulated],
        }


# A reload (SIGHUP) applies these to the running daemon: each is read where it is used (the
# next request, load, upload or registration; models already loaded keep their plans).
RELOADED = frozenset({
    "path", "log_level", "max_model_bytes", "upload_idle_s", "upload_max_s", "shm_max_regions",
    "shm_max_bytes", "shm_allowed_uids", "run_timeout_s", "max_buckets", "max_dim", "runtimes",
    "compile_timeout_s", "objective", "precision", "max_error", "max_batch", "max_delay_us",
    "model_repository"})
# The rest take effect on restart: field -> its key in the file, which a reload that finds
# it changed names in its warning (the daemon keeps running as it started).
ON_RESTART = {
    "unix_socket": "listen.unix", "tcp": "listen.tcp", "http": "listen.http",
    "token": "listen.token",
    "tls_cert": "listen.tls", "tls_key": "listen.tls", "tls_client_ca": "listen.tls",
    "insecure_loopback": "listen.insecure_loopback", "state_dir": "state_dir",
    "cache_dir": "cache_dir", "cpu_enabled": "devices.cpu", "cpu_cores": "devices.cpu",
    "gpu_enabled": "devices.gpu", "openvino_enabled": "devices.openvino",
    "emulated": "devices.emulated", "overrides": "devices.overrides",
    "max_concurrent_uploads": "limits.max_concurrent_uploads",
    "max_connections": "limits.max_connections",
    "max_connections_per_uid": "limits.max_connections_per_uid",
    "idle_timeout_s": "limits.idle_timeout_s", "rpc_threads": "limits.rpc_threads",
    "http_limits": "limits.http", "shm_allow_tcp_clients": "shm.allow_tcp_clients",
    "fast_path": "shm.fast_path",
    "max_in_flight": "engine.max_in_flight", "workers": "engine.workers",
    "metrics_enabled": "metrics.enabled", "metrics_listen": "metrics.listen",
    "tracing_exporter": "tracing", "tracing_path": "tracing", "tracing_endpoint": "tracing",
    "tracing_sample_rate": "tracing"}


def build_timeout_s(cfg: Config) -> float:
    """How long a model's whole build may take: several compiles, at least ten minutes."""
    return max(600.0, 4 * cfg.compile_timeout_s)


# key -> (type or tuple of types, default). Nested dicts are their own schema.
_SCHEMA: dict[str, Any] = {
    "listen": {"unix": ((str, type(None)), None), "tcp": ((str, type(None)), None),
               "http": ((str, type(None)), None),
               "token": ((str, type(None)), None), "insecure_loopback": (bool, False),
               "tls": {"cert": ((str, type(None)), None), "key": ((str, type(None)), None),
                       "client_ca": ((str, type(None)), None)}},
    "state_dir": ((str, type(None)), None),
    "model_repository": ((str, type(None)), None),
    "cache_dir": ((str, type(None)), None),
    "log_level": (str, "info"),
    "devices": {
        "cpu": {"enabled": (bool, True), "cores": ((list, type(None)), None)},
        "gpu": {"enabled": (bool, True)},
        "openvino": {"enabled": (bool, True)},
        "emulated": (list, []),
        "overrides": (dict, {}),
    },
    "limits": {
        "max_model_bytes": (int, 2 << 30),
        "max_concurrent_uploads": (int, 2),
        "upload_idle_s": ((int, float), 30),
        "upload_max_s": ((int, float), 3600),
        "max_connections": (int, 256),
        "max_connections_per_uid": (int, 64),
        "idle_timeout_s": ((int, float), 600),
        "rpc_threads": (int, 32),
        "http": {f.name: ((int, float) if isinstance(f.default, float) else int, f.default)
                 for f in dataclasses.fields(HttpLimits)},
    },
    "shm": {"allowed_uids": (list, []), "allow_tcp_clients": (bool, False),
            "max_regions_per_caller": (int, 64), "max_bytes_per_caller": (int, 16 << 30),
            "fast_path": (bool, True)},
    "engine": {"max_in_flight": (int, 4), "objective": (str, "latency"),
               "compile_timeout_s": ((int, float), 300), "workers": (str, "process"),
               "precision": (str, "fp32"), "max_error": ((int, float), 0.01),
               "run_timeout_s": ((int, float), 60), "max_buckets": (int, 8),
               "max_dim": (int, 4096), "runtimes": (dict, {}),
               "batching": {"max_batch": (int, 8), "max_delay_us": (int, 500)}},
    "metrics": {"enabled": (bool, True), "listen": ((str, int, type(None)), None)},
    "tracing": {"exporter": ((str, type(None)), None), "path": ((str, type(None)), None),
                "endpoint": ((str, type(None)), None), "sample_rate": ((int, float), 1.0)},
}

LOG_LEVELS = ("debug", "info", "warning", "error")
EMULATED_KINDS = ("npu", "gpu")
EMULATED_RUNTIMES = ("openvino",)
OVERRIDE_KEYS = (
    "peak_gflops", "mem_bw_gbs", "link_bw_gbs", "link_latency_us", "launch_us", "memory_gb",
)


def _type_name(types: Any) -> str:
    if not isinstance(types, tuple):
        types = (types,)
    names = {bool: "a boolean", int: "an integer", str: "a string", list: "a list",
             dict: "a mapping", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _fill(schema: dict[str, Any], data: Any, prefix: str) -> dict[str, Any]:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix or "<top>", f"expected a mapping, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key in data:
        if key not in schema:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(where, f"unknown key; expected one of {sorted(schema)}")
    for key, spec in schema.items():
        where = f"{prefix}.{key}" if prefix else key
        if isinstance(spec, dict):
            out[key] = _fill(spec, data.get(key), where)
            continue
        types, default = spec
        value = data.get(key, default)
        # bool is an int in Python; an integer key must not accept true/false.
        bad_bool = isinstance(value, bool) and bool not in (
            types if isinstance(types, tuple) else (types,)
        )
        if bad_bool or not isinstance(value, types):
            raise ConfigError(where, f"expected {_type_name(types)}, got {value!r}")
        out[key] = value
    return out


def _core_list(value: Any, key: str) -> list[int]:
    ncpu = os.cpu_count() or 1
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list of core numbers")
    for core in value:
        if isinstance(core, bool) or not isinstance(core, int) or not 0 <= core < ncpu:
            raise ConfigError(key, f"core {core!r} is not a core of this host (0..{ncpu - 1})")
    return list(value)


def _emulated(items: list[Any]) -> list[EmulatedDevice]:
    devices = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        key = f"devices.emulated[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(key, "expected a mapping with id, kind, runtime, cores")
        extra = set(item) - {"id", "kind", "runtime", "cores"}
        if extra:
            raise ConfigError(f"{key}.{sorted(extra)[0]}", "unknown key; expected id, kind, "
                              "runtime, cores")
        dev_id = item.get("id")
        if not isinstance(dev_id, str) or not dev_id.isidentifier():
            raise ConfigError(f"{key}.id", f"expected a name like 'npu0', got {dev_id!r}")
        if dev_id in seen:
            raise ConfigError(f"{key}.id", f"duplicate device id {dev_id!r}")
        seen.add(dev_id)
        kind = item.get("kind")
        if kind not in EMULATED_KINDS:
            raise ConfigError(f"{key}.kind", f"expected one of {EMULATED_KINDS}, got {kind!r}")
        runtime = item.get("runtime", "openvino")
        if runtime not in EMULATED_RUNTIMES:
            raise ConfigError(f"{key}.runtime",
                              f"expected one of {EMULATED_RUNTIMES}, got {runtime!r}")
        cores = _core_list(item.get("cores"), f"{key}.cores")
        devices.append(EmulatedDevice(dev_id, kind, runtime, cores))
    return devices


def _overrides(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    for dev_id, fields in data.items():
        key = f"devices.overrides.{dev_id}"
        if not isinstance(fields, dict):
            raise ConfigError(key, "expected a mapping of profile fields")
        for name, value in fields.items():
            if name not in OVERRIDE_KEYS:
                raise ConfigError(f"{key}.{name}", f"unknown key; expected one of {OVERRIDE_KEYS}")
            if name == "peak_gflops":
                if not isinstance(value, dict) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                    for v in value.values()
                ):
                    raise ConfigError(f"{key}.{name}", "expected a mapping dtype -> GFLOP/s > 0")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{key}.{name}", f"expected a number >= 0, got {value!r}")
    return data


def _default_dir(kind: str) -> Path:
    """systemd's *_DIRECTORY when it runs us, else the XDG location for this user."""
    systemd_var = {"runtime": "RUNTIME_DIRECTORY", "state": "STATE_DIRECTORY",
                   "cache": "CACHE_DIRECTORY"}[kind]
    if os.environ.get(systemd_var):
        return Path(os.environ[systemd_var].split(":")[0])
    home = Path.home()
    if kind == "runtime":
        xdg_runtime = os.environ.get("XDG_RUNTIME_DIR")
        return Path(xdg_runtime) / "cuvild" if xdg_runtime else Path(f"/tmp/cuvild-{os.getuid()}")
    xdg = {"state": ("XDG_STATE_HOME", home / ".local/state"),
           "cache": ("XDG_CACHE_HOME", home / ".cache")}[kind]
    return Path(os.environ.get(xdg[0]) or xdg[1]) / "cuvild"


def default_socket() -> str:
    return str(_default_dir("runtime") / "cuvild.sock")


def _writable_dir(value: str | None, kind: str, key: str) -> Path:
    path = Path(value).expanduser() if value else _default_dir(kind)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise ConfigError(key, f"cannot create directory {path}: {e.strerror}") from None
    check_private_dir(path, key)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(key, f"directory {path} is not writable")
    return path


def check_private_dir(path: Path, key: str) -> None:
    """Refuse a directory another user could have made or can write: whoever controls the
    socket's directory can hijack or block the socket, and the cache holds code that is loaded
    as shared libraries."""
    me = os.geteuid()
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        raise ConfigError(key, f"{path} is a symlink owned by uid {link.st_uid}; cuvild follows "
                          "no other user's links: remove it or point the config elsewhere")
    st = os.stat(path)
    problem = (f"is owned by uid {st.st_uid}, not by cuvild's user (uid {me}) or root"
               if st.st_uid not in (me, 0) else
               f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
               if st.st_mode & 0o022 else None)
    if problem:
        raise ConfigError(key, f"directory {path} {problem}: another user could replace what "
                          "cuvild keeps there; remove it, or chown it to cuvild's user and "
                          "chmod go-w it")


def _check_listen(listen: dict[str, Any]) -> tuple[str | None, str | None, dict[str, Any]]:  # noqa: C901 - a check per key, in the file's order
    """listen.*: addresses, TLS files, and what guards a listener off the unix socket."""
    tcp, http = listen["tcp"], listen["http"]
    for key, address in (("listen.tcp", tcp), ("listen.http", http)):
        if address is not None and (":" not in address
                                    or not address.rsplit(":", 1)[1].isdigit()):
            raise ConfigError(key, f"expected HOST:PORT, got {address!r}")
    tls = listen["tls"]
    if bool(tls["cert"]) != bool(tls["key"]):
        raise ConfigError("listen.tls", "cert and key go together")
    if tls["client_ca"] and not tls["cert"]:
        raise ConfigError("listen.tls.client_ca", "mutual TLS needs the server's cert and key")
    for key in ("cert", "key", "client_ca"):
        if tls[key] and not os.access(tls[key], os.R_OK):
            raise ConfigError(f"listen.tls.{key}", f"cannot read {tls[key]}")
    for address in (tcp, http):
        if address is None:
            continue
        host = address.rsplit(":", 1)[0].strip("[]")
        if not listen["token"] and not tls["client_ca"]:
            if not (listen["insecure_loopback"] and _is_loopback(host)):
                raise ConfigError("listen.token", "a TCP or HTTP listener needs a bearer "
                                  "token or mutual TLS (listen.tls.client_ca), or "
                                  "listen.insecure_loopback: true with a loopback host")
        elif listen["token"] and not _is_loopback(host):
            _check_token(listen["token"])
    return tcp, http, tls


PLACEHOLDER_TOKENS = ("replace-with-a-long-random-token",)  # configs/kserve's sample
MIN_TOKEN_CHARS = 32


def _check_token(token: str) -> None:
    """A token that guards a listener off this host: not the sample's, not short (a token
    is all that stands between the network and the daemon's models and memory)."""
    if token in PLACEHOLDER_TOKENS:
        raise ConfigError("listen.token", "is the sample's placeholder: put a random one "
                          "there (e.g. `openssl rand -hex 32`)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError("listen.token", f"{len(token)} characters: a listener off this "
                          f"host needs at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex "
                          "32`)")


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse(data: Any, path: str = "<memory>") -> Config:  # noqa: C901 - a check per config section, in the file's order
    """Validate a config mapping (as read from YAML) and build a Config. Creates directories."""
    raw = _fill(_SCHEMA, data, "")
    if raw["log_level"] not in LOG_LEVELS:
        raise ConfigError("log_level", f"expected one of {LOG_LEVELS}, got {raw['log_level']!r}")
    dev = raw["devices"]
    cpu_cores = dev["cpu"]["cores"]
    if cpu_cores is not None:
        cpu_cores = _core_list(cpu_cores, "devices.cpu.cores")
    emulated = _emulated(dev["emulated"])
    for e in emulated:
        if e.id.startswith("cpu"):
            raise ConfigError("devices.emulated", f"id {e.id!r} clashes with the host CPU's ids")
    tcp, http, tls = _check_listen(raw["listen"])
    metrics_listen = _metrics_listen(raw["metrics"])
    _check_tracing(raw["tracing"])
    uids = raw["shm"]["allowed_uids"]
    if not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in uids):
        raise ConfigError("shm.allowed_uids", f"expected a list of user ids, got {uids!r}")
    eng = raw["engine"]
    if eng["objective"] not in ("latency", "throughput"):
        raise ConfigError("engine.objective", f"expected latency or throughput, got "
                          f"{eng['objective']!r}")
    if eng["workers"] not in ("process", "thread"):
        raise ConfigError("engine.workers", f"expected process or thread, got "
                          f"{eng['workers']!r}")
    if eng["max_in_flight"] <= 0 or eng["compile_timeout_s"] <= 0:
        raise ConfigError("engine", "max_in_flight and compile_timeout_s must be positive")
    if eng["precision"] not in ("fp32", "auto"):
        raise ConfigError("engine.precision", f"expected fp32 or auto, got {eng['precision']!r}")
    _check_runtimes(eng["runtimes"])
    batching = eng["batching"]
    if not 1 <= batching["max_batch"] <= 1024 or not 0 <= batching["max_delay_us"] <= 10**6:
        raise ConfigError("engine.batching", f"expected max_batch in [1, 1024] (1: off) and "
                          f"max_delay_us in [0, 1000000], got {batching}")
    if not 0 < eng["max_error"] < 1:
        raise ConfigError("engine.max_error", f"expected a relative error in (0, 1), got "
                          f"{eng['max_error']!r}")
    _positive(raw, ("limits", "max_model_bytes"), ("limits", "max_concurrent_uploads"),
              ("limits", "upload_idle_s"), ("limits", "upload_max_s"),
              ("limits", "max_connections"), ("limits", "max_connections_per_uid"),
              ("limits", "idle_timeout_s"), ("shm", "max_regions_per_caller"),
              ("shm", "max_bytes_per_caller"), ("engine", "run_timeout_s"),
              ("engine", "max_buckets"), ("engine", "max_dim"))
    _check_limits(raw)
    unix = raw["listen"]["unix"] or default_socket()
    sock_dir = _writable_dir(str(Path(unix).parent), "runtime", "listen.unix")
    return Config(
        path=path,
        unix_socket=str(sock_dir / Path(unix).name),
        tcp=tcp,
        http=http,
        state_dir=_writable_dir(raw["state_dir"], "state", "state_dir"),
        cache_dir=_writable_dir(raw["cache_dir"], "cache", "cache_dir"),
        log_level=raw["log_level"],
        cpu_enabled=dev["cpu"]["enabled"],
        cpu_cores=cpu_cores,
        gpu_enabled=dev["gpu"]["enabled"],
        openvino_enabled=dev["openvino"]["enabled"],
        emulated=emulated,
        overrides=_overrides(dev["overrides"]),
        max_model_bytes=raw["limits"]["max_model_bytes"],
        max_concurrent_uploads=raw["limits"]["max_concurrent_uploads"],
        upload_idle_s=float(raw["limits"]["upload_idle_s"]),
        upload_max_s=float(raw["limits"]["upload_max_s"]),
        max_connections=raw["limits"]["max_connections"],
        max_connections_per_uid=raw["limits"]["max_connections_per_uid"],
        idle_timeout_s=float(raw["limits"]["idle_timeout_s"]),
        rpc_threads=raw["limits"]["rpc_threads"],
        http_limits=HttpLimits(**raw["limits"]["http"]),
        shm_max_regions=raw["shm"]["max_regions_per_caller"],
        shm_max_bytes=raw["shm"]["max_bytes_per_caller"],
        run_timeout_s=float(eng["run_timeout_s"]),
        max_buckets=eng["max_buckets"],
        max_dim=eng["max_dim"],
        runtimes={k: list(v) for k, v in eng["runtimes"].items()},
        token=raw["listen"]["token"],
        tls_cert=tls["cert"],
        tls_key=tls["key"],
        tls_client_ca=tls["client_ca"],
        insecure_loopback=raw["listen"]["insecure_loopback"],
        shm_allowed_uids=list(uids),
        shm_allow_tcp_clients=raw["shm"]["allow_tcp_clients"],
        fast_path=raw["shm"]["fast_path"],
        max_in_flight=eng["max_in_flight"],
        objective=eng["objective"],
        compile_timeout_s=float(eng["compile_timeout_s"]),
        workers=eng["workers"],
        precision=eng["precision"],
        max_error=float(eng["max_error"]),
        max_batch=eng["batching"]["max_batch"],
        max_delay_us=eng["batching"]["max_delay_us"],
        metrics_enabled=raw["metrics"]["enabled"],
        metrics_listen=metrics_listen,
        tracing_exporter=raw["tracing"]["exporter"],
        tracing_path=raw["tracing"]["path"],
        tracing_endpoint=raw["tracing"]["endpoint"],
        tracing_sample_rate=float(raw["tracing"]["sample_rate"]),
        model_repository=raw["model_repository"] and repository_dir(raw["model_repository"]),
    )


def repository_dir(value: str) -> str:
    """A model repository's directory (config `model_repository`, `cuvild --model-repository`),
    absolute; it must exist and be readable (its entries are checked when it is read)."""
    path = Path(value).expanduser().absolute()
    if not path.is_dir() or not os.access(path, os.R_OK | os.X_OK):
        raise ConfigError("model_repository", f"{value!r} is not a readable directory")
    return str(path)


def _check_limits(raw: dict[str, Any]) -> None:
    _positive(raw, *(("limits", "http", f.name) for f in dataclasses.fields(HttpLimits)))
    if raw["limits"]["rpc_threads"] < 8:
        raise ConfigError("limits.rpc_threads", f"expected at least 8 (4 are kept for health "
                          f"and status), got {raw['limits']['rpc_threads']}")


def _positive(raw: dict[str, Any], *keys: tuple[str, ...]) -> None:
    """Each key (a path of sections, then the key) holds a number > 0."""
    for path in keys:
        value: Any = raw
        for part in path:
            value = value[part]
        if value <= 0:
            raise ConfigError(".".join(path), f"expected a positive number, got {value!r}")


def _check_runtimes(data: dict[Any, Any]) -> None:
    """engine.runtimes: device id or kind -> a non-empty list of known runtime names (a typo
    would otherwise leave a device with nothing to build with, found only at the first load)."""
    from runtimes.registry import RUNTIMES  # no torch: cheap

    for device, names in data.items():
        key = f"engine.runtimes.{device}"
        if not isinstance(device, str) or not device:
            raise ConfigError("engine.runtimes", f"expected device ids or kinds as keys, got "
                              f"{device!r}")
        if not isinstance(names, list) or not names:
            raise ConfigError(key, f"expected a non-empty list of runtimes, got {names!r}")
        for name in names:
            if name not in RUNTIMES:
                raise ConfigError(key, f"unknown runtime {name!r}; expected one of "
                                  f"{sorted(RUNTIMES)}")


def _metrics_listen(metrics: dict[str, Any]) -> str | None:
    """metrics.listen as HOST:PORT; a bare port (or ":PORT") listens on loopback only."""
    listen = metrics["listen"]
    if listen is None:
        return None
    if not metrics["enabled"]:
        raise ConfigError("metrics.listen", "metrics.enabled is false: nothing to serve")
    text = str(listen)
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("metrics.listen", f"expected PORT or HOST:PORT, got {listen!r}")
    return f"{host or '127.0.0.1'}:{port}"


def _check_tracing(tracing: dict[str, Any]) -> None:
    exporter = tracing["exporter"]
    if exporter not in (None, "file", "otlp"):
        raise ConfigError("tracing.exporter", f"expected file, otlp or null, got {exporter!r}")
    if exporter == "file" and not tracing["path"]:
        raise ConfigError("tracing.path", "the file exporter writes JSON lines to a path")
    if exporter == "otlp" and not tracing["endpoint"]:
        raise ConfigError("tracing.endpoint", "the otlp exporter needs a collector's URL, "
                          "e.g. http://localhost:4318/v1/traces")
    if not 0 <= tracing["sample_rate"] <= 1:
        raise ConfigError("tracing.sample_rate", f"expected a share in [0, 1], got "
                          f"{tracing['sample_rate']!r}")


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError("<file>", f"cannot read {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("<file>", f"{path} is not valid YAML: {e}") from None
    return parse(data, str(path))
