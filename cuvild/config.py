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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cuvild.config_checks import ConfigError, check_listen, check_tracing, metrics_listen


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


def setting(key: str, default: Any, doc: str, *, reload: bool = False, types: Any = None,
            choices: tuple[Any, ...] = (), positive: bool = False,
            read: Callable[[Any, str], Any] | None = None) -> Any:
    """One key of cuvild.yaml, declared once: where it is in the file (dotted), its default,
    what it does (`doc`), whether a reload applies it (else a restart), its YAML types where
    the field's own type does not say them, its allowed values, and how its value is read
    (`read(value, key)`, which may refuse it naming the key). The schema, the defaults, the
    reload rule and the docs table (`table`) all come from these."""
    meta = {"key": key, "doc": doc, "reload": reload, "types": types, "choices": choices,
            "positive": positive, "read": read}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _dir(kind: str) -> Callable[[Any, str], Path]:
    return lambda value, key: _writable_dir(value, kind, key)


@dataclass
class Config:  # a key per field; `path` alone is not one (the file it was read from)
    path: str = field(default="<memory>", metadata={"reload": True})
    unix_socket: str | None = setting(
        "listen.unix", None, "the unix socket (default: $RUNTIME_DIRECTORY or XDG's)")
    tcp: str | None = setting("listen.tcp", None, "HOST:PORT of the gRPC listener off the "
                              "unix socket (needs listen.token or mutual TLS)")
    http: str | None = setting("listen.http", None, "HOST:PORT of the protocol's HTTP/REST form")
    token: str | None = setting("listen.token", None, "bearer token for TCP and HTTP callers")
    insecure_loopback: bool = setting("listen.insecure_loopback", False,
                                      "TCP/HTTP on a loopback host with no token")
    tls_cert: str | None = setting("listen.tls.cert", None, "server certificate (PEM)")
    tls_key: str | None = setting("listen.tls.key", None, "its key (PEM)")
    tls_client_ca: str | None = setting("listen.tls.client_ca", None,
                                        "CA of client certificates: mutual TLS")
    state_dir: Path = setting("state_dir", None, "models registered (default: "
                              "$STATE_DIRECTORY or XDG's)", types=(str, type(None)),
                              read=_dir("state"))
    cache_dir: Path = setting("cache_dir", None, "compile cache and load records (default: "
                              "$CACHE_DIRECTORY or XDG's)", types=(str, type(None)),
                              read=_dir("cache"))
    model_repository: str | None = setting(
        "model_repository", None, "DIR/<name>/<version>/model.pt2, served at start",
        reload=True, read=lambda v, key: v and repository_dir(v))
    log_level: str = setting("log_level", "info", "debug, info, warning or error", reload=True,
                             choices=("debug", "info", "warning", "error"))
    cpu_enabled: bool = setting("devices.cpu.enabled", True, "serve on the host CPU")
    cpu_cores: list[int] | None = setting(
        "devices.cpu.cores", None, "the cores it may use (default: all)",
        read=lambda v, key: v if v is None else _core_list(v, key))
    gpu_enabled: bool = setting("devices.gpu.enabled", True, "serve on CUDA GPUs found")
    cuda_graphs: bool = setting("devices.gpu.cuda_graphs", True, "run each static-shape GPU "
                                "part as one CUDA graph (captured at its first request)")
    openvino_enabled: bool = setting("devices.openvino.enabled", True,
                                     "serve on OpenVINO's NPU where found")
    emulated: list[EmulatedDevice] = setting(
        "devices.emulated", [], "devices emulated on CPU cores (id, kind, runtime, cores)",
        read=lambda v, key: _emulated(v))
    overrides: dict[str, dict[str, Any]] = setting(
        "devices.overrides", {}, "profile fields set by hand, per device id",
        read=lambda v, key: _overrides(v))
    max_model_bytes: int = setting("limits.max_model_bytes", 2 << 30, "largest archive",
                                   reload=True, positive=True)
    max_concurrent_uploads: int = setting("limits.max_concurrent_uploads", 2,
                                          "uploads at once", positive=True)
    upload_idle_s: float = setting("limits.upload_idle_s", 30.0, "an upload silent this long "
                                   "is cancelled", reload=True, positive=True)
    upload_max_s: float = setting("limits.upload_max_s", 3600.0, "and one still going after "
                                  "this", reload=True, positive=True)
    max_connections: int = setting("limits.max_connections", 256, "unix connections at once",
                                   positive=True)
    max_connections_per_uid: int = setting("limits.max_connections_per_uid", 64,
                                           "of them per user", positive=True)
    idle_timeout_s: float = setting("limits.idle_timeout_s", 600.0, "a silent unix "
                                    "connection is closed after this", positive=True)
    rpc_threads: int = setting("limits.rpc_threads", 32, "gRPC handler threads per listener "
                               "(4 kept for quick calls; at least 8)")
    http_limits: HttpLimits = setting("limits.http", None, "what one HTTP listener lets a "
                                      "client hold (docs/OPERATIONS.md)", types=dict,
                                      read=lambda v, key: HttpLimits(**v))
    shm_allowed_uids: list[int] = setting("shm.allowed_uids", [], "uids whose regions TCP "
                                          "callers may name", reload=True)
    shm_allow_tcp_clients: bool = setting("shm.allow_tcp_clients", False,
                                          "system shared memory off the unix socket")
    shm_max_regions: int = setting("shm.max_regions_per_caller", 64, "regions per caller",
                                   reload=True, positive=True)
    shm_max_bytes: int = setting("shm.max_bytes_per_caller", 16 << 30, "their bytes, summed",
                                 reload=True, positive=True)
    fast_path: bool = setting("shm.fast_path", True, "same-host sessions on the unix socket")
    max_in_flight: int = setting("engine.max_in_flight", 4, "requests run at once (not a "
                                 "generation's steps)",
                                 positive=True)
    objective: str = setting("engine.objective", "latency", "what plans minimise",
                             reload=True, choices=("latency", "throughput"))
    compile_timeout_s: float = setting("engine.compile_timeout_s", 300.0, "one compile",
                                       reload=True, positive=True)
    workers: str = setting("engine.workers", "process", "device workers as processes or "
                           "threads of the daemon", choices=("process", "thread"))
    omp_wait: str = setting("engine.omp_wait", "auto", "how the workers' OpenMP threads wait "
                            "between parallel regions: auto spins briefly unless two devices "
                            "share cores, then passive (also for hosts shared with other work)",
                            choices=("auto", "spin", "passive"))
    precision: str = setting("engine.precision", "fp32", "the policy of a model loaded "
                             "without one", reload=True, choices=("fp32", "auto"))
    max_error: float = setting("engine.max_error", 0.01, "the error budget of auto, in (0, 1)",
                               reload=True)
    run_timeout_s: float = setting("engine.run_timeout_s", 60.0, "a request's deadline when "
                                   "its caller gives none", reload=True, positive=True)
    max_buckets: int = setting("engine.max_buckets", 8, "input shapes kept per dynamic-shape "
                               "model", reload=True, positive=True)
    max_dim: int = setting("engine.max_dim", 4096, "largest size built for a dynamic "
                           "dimension", reload=True, positive=True)
    max_sequences: int = setting("engine.sequences.max_live", 64, "a stateful model's "
                                 "sequences live at once (their state kept in the workers)",
                                 positive=True)
    sequence_idle_s: float = setting("engine.sequences.idle_timeout_s", 300.0, "a sequence "
                                     "idle this long ends", positive=True)
    prefix_cache_mib: int = setting("engine.sequences.prefix_cache_mib", 1024, "finished "
                                    "generations' state kept for later prompts that begin "
                                    "with their tokens (a chat's next turn; 0: none)")
    compile_steps: bool = setting("engine.sequences.compile_steps", True, "compile a "
                                  "language model's decode step at its first use (inductor), "
                                  "served where it measures faster")
    mixed_prompt: bool = setting("engine.sequences.mixed_prompt", True, "under an error "
                                 "budget, a language model's prompt chunks on a CPU may run "
                                 "bf16 but for their sensitive layers, held on their logits "
                                 "and on the cache they leave: a sooner first token (false: "
                                 "a shorter first load, no mix searched)")
    warm_up: bool = setting("engine.sequences.warm_up", True, "warm a language model up "
                            "before it is READY: its decode step and longest prompt chunk "
                            "built, its decode step compiled (false: at their first use)")
    runtimes: dict[str, list[str]] = setting(
        "engine.runtimes", {}, "device id or kind -> the runtimes auto may try ({}: all)",
        reload=True, read=lambda v, key: _runtimes(v))
    max_batch: int = setting("engine.batching.max_batch", 8, "rows merged into one run, in "
                             "[1, 1024] (1: off)", reload=True)
    max_delay_us: int = setting("engine.batching.max_delay_us", 500, "how long the oldest "
                                "queued request waits for others, in [0, 1000000]", reload=True)
    metrics_enabled: bool = setting("metrics.enabled", True, "Prometheus metrics")
    metrics_listen: str | None = setting(
        "metrics.listen", None, "PORT or HOST:PORT of /metrics (a bare port: loopback)",
        types=(str, int, type(None)))
    tracing_exporter: str | None = setting("tracing.exporter", None, "file, otlp or null (off)",
                                           choices=(None, "file", "otlp"))
    tracing_path: str | None = setting("tracing.path", None, "the file exporter's JSON lines")
    tracing_endpoint: str | None = setting("tracing.endpoint", None, "the otlp collector's URL")
    tracing_sample_rate: float = setting("tracing.sample_rate", 1.0, "share of requests "
                                         "traced, in [0, 1]")

    def device_settings(self) -> dict[str, Any]:
        """The settings that change what the profiler measures (part of the cache key)."""
        return {
            "cpu": {"enabled": self.cpu_enabled, "cores": self.cpu_cores},
            "gpu": self.gpu_enabled,
            "openvino": self.openvino_enabled,
            "emulated": [vars(e) for e in self.emulated],
        }


KEYS = [f for f in dataclasses.fields(Config) if f.metadata.get("key")]
# A reload (SIGHUP, `cuvilctl reload`) applies these to the running daemon: each is read where
# it is used (the next request, load, upload or registration; loaded models keep their plans).
RELOADED = frozenset(f.name for f in dataclasses.fields(Config) if f.metadata.get("reload"))
# The rest take effect on restart: field -> its key, which a reload that finds it changed
# names in its warning (the daemon keeps running as it started).
ON_RESTART = {f.name: f.metadata["key"] for f in KEYS if not f.metadata["reload"]}


def build_timeout_s(cfg: Config) -> float:
    """How long a model's whole build may take: several compiles, at least ten minutes."""
    return max(600.0, 4 * cfg.compile_timeout_s)


def _types(f: dataclasses.Field[Any]) -> Any:
    """The YAML types a key takes: declared, or read from its field's type."""
    if f.metadata["types"] is not None:
        return f.metadata["types"]
    text = str(f.type)
    base = text.split("|")[0].strip().split("[")[0]
    types = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,),
             "list": (list,), "dict": (dict,)}[base]
    return (*types, type(None)) if "None" in text else types


def _schema() -> dict[str, Any]:
    """key -> (types, default), nested by section, from the declarations."""
    schema: dict[str, Any] = {}
    for f in KEYS:
        *sections, name = f.metadata["key"].split(".")
        at = schema
        for section in sections:
            at = at.setdefault(section, {})
        if f.name == "http_limits":  # a section of its own: HttpLimits' fields
            at[name] = {h.name: ((int, float) if isinstance(h.default, float) else int,
                                 h.default) for h in dataclasses.fields(HttpLimits)}
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        at[name] = (_types(f), default)
    return schema


_SCHEMA = _schema()


def table() -> str:
    """Every key of cuvild.yaml as a Markdown table: default, when it applies, what it does
    (docs/OPERATIONS.md holds it; tests/serve/test_config.py checks it is this)."""
    rows = ["| key | default | applies | what |", "|---|---|---|---|"]
    for f in KEYS:
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        shown = "see below" if f.name == "http_limits" else (
            "null" if default is None else str(default).lower() if isinstance(default, bool)
            else default)
        rows.append(f"| `{f.metadata['key']}` | `{shown}` | "
                    f"{'reload' if f.metadata['reload'] else 'restart'} | {f.metadata['doc']} |")
    return "\n".join(rows) + "\n"


EMULATED_KINDS = ("npu", "gpu")
EMULATED_RUNTIMES = ("openvino",)
OVERRIDE_KEYS = (
    "peak_gflops", "mem_bw_gbs", "link_bw_gbs", "link_latency_us", "launch_us", "memory_gb",
    "call_us", "kernel_us",
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


def parse(data: Any, path: str = "<memory>") -> Config:
    """Validate a config mapping (as read from YAML) and build a Config. Creates directories.
    Each key is checked as it is declared (types, allowed values, > 0, its reader), then
    what ties keys together."""
    raw = _fill(_SCHEMA, data, "")
    values: dict[str, Any] = {}
    for f in KEYS:
        key, meta = f.metadata["key"], f.metadata
        value: Any = raw
        for part in key.split("."):
            value = value[part]
        if meta["choices"] and value not in meta["choices"]:
            names = ["null" if c is None else str(c) for c in meta["choices"]]
            shown = ", ".join(names[:-1]) + " or " + names[-1]
            raise ConfigError(key, f"expected {shown}, got {value!r}")
        if meta["positive"] and value <= 0:
            raise ConfigError(key, f"expected a positive number, got {value!r}")
        if meta["read"] is not None:
            value = meta["read"](value, key)
        elif str(f.type) == "float":
            value = float(value)
        values[f.name] = value
    cfg = Config(path=path, **values)
    _check_together(cfg, raw)
    unix = cfg.unix_socket or default_socket()
    sock_dir = _writable_dir(str(Path(unix).parent), "runtime", "listen.unix")
    cfg.unix_socket = str(sock_dir / Path(unix).name)
    return cfg


def _check_together(cfg: Config, raw: dict[str, Any]) -> None:
    """What ties keys together, or a key's range past what its declaration says."""
    for e in cfg.emulated:
        if e.id.startswith("cpu"):
            raise ConfigError("devices.emulated", f"id {e.id!r} clashes with the host CPU's ids")
    check_listen(raw["listen"])
    cfg.metrics_listen = metrics_listen(raw["metrics"])
    check_tracing(raw["tracing"])
    uids = cfg.shm_allowed_uids
    if not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in uids):
        raise ConfigError("shm.allowed_uids", f"expected a list of user ids, got {uids!r}")
    if not 1 <= cfg.max_batch <= 1024 or not 0 <= cfg.max_delay_us <= 10**6:
        raise ConfigError("engine.batching", f"expected max_batch in [1, 1024] (1: off) and "
                          f"max_delay_us in [0, 1000000], got {raw['engine']['batching']}")
    if not 0 < cfg.max_error < 1:
        raise ConfigError("engine.max_error", f"expected a relative error in (0, 1), got "
                          f"{cfg.max_error!r}")
    for f in dataclasses.fields(HttpLimits):
        if getattr(cfg.http_limits, f.name) <= 0:
            raise ConfigError(f"limits.http.{f.name}", "expected a positive number, got "
                              f"{getattr(cfg.http_limits, f.name)!r}")
    if cfg.rpc_threads < 8:
        raise ConfigError("limits.rpc_threads", f"expected at least 8 (4 are kept for health "
                          f"and status), got {cfg.rpc_threads}")


def repository_dir(value: str) -> str:
    """A model repository's directory (config `model_repository`, `cuvild --model-repository`),
    absolute; it must exist and be readable (its entries are checked when it is read)."""
    path = Path(value).expanduser().absolute()
    if not path.is_dir() or not os.access(path, os.R_OK | os.X_OK):
        raise ConfigError("model_repository", f"{value!r} is not a readable directory")
    return str(path)


def _runtimes(data: dict[Any, Any]) -> dict[str, list[str]]:
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
    return {k: list(v) for k, v in data.items()}


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
