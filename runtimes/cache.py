"""Content-addressed compile cache under cache_dir, size-bounded with LRU eviction.

Key = the part's graph code and weights + runtime and its version + the device (kind, name,
features, cores, emulated) + precision + input shapes. An entry is a directory written under
a temporary name and renamed into place, so a crash never leaves a half entry visible.
The per-part choice of runtime (`auto`) is cached too, so a restarted daemon loads only the
winner and compiles nothing. And a per-device, per-precision tally of past searches (the
prior, `choices/prior-<device>-<precision>.json`) lets the next search try the likely winner
first and leave out runtimes that never come close (runtimes/select.py).

An entry is code the daemon loads (an .so, a .vmfb, an OpenVINO blob), so it is signed: a
manifest of every file's sha256, the runtime and version that built it, and an HMAC over them
with a key only the daemon holds (`CUVILD_CACHE_KEY_FILE`, which the daemon points at
state_dir/cache.key, mode 0600; for a cache shared by pods, a key from a Kubernetes Secret).
`lookup` verifies it before anything of the entry is loaded; one that fails (a file changed,
added or missing, no manifest, another key) is dropped, counted (`rejected`) and rebuilt.
Whoever can write the cache but not read the key can make cuvild compile again, not load
their code. Without the key file's variable (tests, a library user) the key is the user's
state directory's (~/.local/state/cuvild/cache.key), made on first use.
"""

from __future__ import annotations

import getpass
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.profile import DeviceProfile
from runtimes.base import INITIAL, fsync_dir, remove_leftovers, write_atomic

if TYPE_CHECKING:  # torch is imported only to hash a graph: a worker that loads builds
    from torch import fx  # from the cache need not import it (cuvild/workers/worker.py)

log = logging.getLogger(__name__)
PRIOR_KEEP = 20  # times and compile times kept per runtime: recent ones, so upgrades show
MANIFEST = "manifest.json"
KEY_ENV = "CUVILD_CACHE_KEY_FILE"


def keep_inductor_headers(tmp: str) -> None:
    """inductor's precompiled headers kept in its cache directory (TORCHINDUCTOR_CACHE_DIR,
    the daemon's cache_dir/inductor) for a process whose temporary directory is `tmp`:
    inductor puts them under the temporary directory whatever that variable says (its
    `default_cache_dir()`), and a daemon's is its scratch, made and removed with each
    process, so every daemon's first C++ compile built them again (5 s of the 200M Llama's
    28 s decode-step compile on the 2-core dev host). A link from where inductor looks; they
    are content-addressed (the preprocessed header, the command line, the compiler), and
    built under inductor's own lock. Were torch to name that place otherwise, the link goes
    unused and they are built as before (tests/runtimes/test_select.py checks the name)."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not inductor or not tmp:
        return
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    looked = Path(tmp) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    kept = Path(inductor) / "precompiled_headers"
    try:
        kept.mkdir(parents=True, exist_ok=True)
        looked.mkdir(exist_ok=True)
        (looked / "precompiled_headers").symlink_to(kept, target_is_directory=True)
    except OSError as e:  # (built in the scratch, as before)
        log.debug("inductor's precompiled headers stay in %s: %s", looked, e)


def cache_key_file(path: Path | None = None) -> bytes:
    """The signing key: 32 random bytes in `path` (default: $CUVILD_CACHE_KEY_FILE, else the
    user's state directory's cache.key), made (mode 0600) if it is not there."""
    if path is None:
        env = os.environ.get(KEY_ENV)
        base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        path = Path(env) if env else base / "cuvild" / "cache.key"
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            return path.read_bytes()
        key = os.urandom(32)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
    if len(key) < 16:
        raise ValueError(f"{path}: a cache key of {len(key)} bytes (at least 16 expected)")
    return key


def _file_digests(entry: Path) -> dict[str, str]:
    out = {}
    for p in sorted(entry.rglob("*")):
        if p.is_file() and p != entry / MANIFEST:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            out[str(p.relative_to(entry))] = h.hexdigest()
    return out


def graph_digest(module: fx.GraphModule) -> str:
    """Hash of a part: its code and every weight's dtype, shape and bytes; of a stateful
    part's state, the values before any run (runtimes/torch_eager.py `remember_initial`: a run
    writes its cache, and the part is the same part after it)."""
    h = hashlib.sha256(module.code.encode())
    for name, tensor in sorted({**dict(module.named_buffers()),
                                **dict(module.named_parameters()),
                                **module.meta.get(INITIAL, {})}.items()):
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(weight_digest(tensor))
    return h.hexdigest()


# A weight's digest by the tensor it was read from, while that tensor lives and its data is
# unchanged: every bucket of a model (and its generation twin) holds the same weights, and
# hashing a 200M model's took ~0.6 s a build.
_WEIGHTS: dict[int, tuple[weakref.ref, tuple[Any, ...], bytes]] = {}


def weight_digest(tensor: Any) -> bytes:
    """sha256 of a tensor's bytes (kept for that tensor object while its storage, version,
    dtype, shape and strides stay what they were)."""
    import torch

    stamp = (tensor.data_ptr(), tensor._version, tensor.dtype, tuple(tensor.shape),  # noqa: SLF001 - bumped by every in-place write
             tuple(tensor.stride()))
    kept = _WEIGHTS.get(id(tensor))
    if kept is not None and kept[0]() is tensor and kept[1] == stamp:
        return kept[2]
    t = tensor.detach().contiguous().cpu()
    digest = (hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).digest() if t.numel()
              else b"")
    key = id(tensor)
    _WEIGHTS[key] = (weakref.ref(tensor, lambda _, key=key: _WEIGHTS.pop(key, None)), stamp,
                     digest)
    return digest


def device_digest(device: DeviceProfile) -> dict[str, Any]:
    return {"kind": device.kind, "name": device.name, "features": sorted(device.features),
            "cores": len(device.cores), "emulated": device.emulated}


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _dir_size(path: Path) -> int:
    """Bytes of the files under `path`; 0 for what another process removes meanwhile."""
    total = 0
    for folder, _, files in os.walk(path):  # (errors, a folder gone, skipped)
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                continue
    return total


class CompileCache:
    def __init__(self, root: Path, max_bytes: int = 10 << 30, key: bytes | None = None) -> None:
        self.root = root
        self.entries = root / "compiled"
        self.choices = root / "choices"
        self.max_bytes = max_bytes
        self._key = key  # the signing key (cache_key_file), read on first use
        self.rejected = 0  # entries that failed verification since this cache was opened
        self._lock = threading.Lock()
        for d in (self.entries, self.choices):
            d.mkdir(parents=True, exist_ok=True)
        # a crash mid-write (each worker makes one: young temps may be another's write)
        # (and compile markers of workers long gone: runtimes/crashes.py)
        remove_leftovers(root, "compiled/.tmp-*", "choices/.tmp-*", "crashes/*.trying")

    # -- keys ----------------------------------------------------------------------------
    @staticmethod
    def part_key(part_digest: str, device: DeviceProfile, precision: str,
                 shapes: list[Any]) -> str:
        """Identifies the compile problem, whatever runtime solves it."""
        return _key(part_digest, device_digest(device), precision, shapes)

    @staticmethod
    def entry_key(part_key: str, runtime: str, runtime_version: str) -> str:
        return _key(part_key, runtime, runtime_version)

    # -- entries -------------------------------------------------------------------------
    def lookup(self, key: str) -> Path | None:
        """The entry, verified against its signed manifest; None when there is none or it
        failed (then it is dropped: the caller builds it again)."""
        path = self.entries / key
        if not (path / "meta.json").exists():
            return None
        why = self._unverified(path)
        if why:
            self.rejected += 1
            log.warning("compile cache: entry %s failed verification (%s); building it again",
                        key, why)
            self.drop(key)
            return None
        os.utime(path / "meta.json")  # LRU: last use is the meta file's mtime
        return path

    def _signing_key(self) -> bytes:
        if self._key is None:
            self._key = cache_key_file()
        return self._key

    def _signature(self, files: dict[str, str]) -> str:
        return hmac.new(self._signing_key(), json.dumps(files, sort_keys=True).encode(),
                        hashlib.sha256).hexdigest()

    def _unverified(self, entry: Path) -> str:
        """Why `entry` cannot be trusted; "" when its manifest and signature hold."""
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
            files, signature = dict(manifest["files"]), str(manifest["hmac"])
        except FileNotFoundError:
            return "no signed manifest"
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"unreadable manifest: {e}"
        if not hmac.compare_digest(self._signature(files), signature):
            return "its signature is not this daemon's"
        present = _file_digests(entry)
        if present != files:
            changed = sorted(set(present) ^ set(files) | {f for f in files
                                                          if present.get(f) != files[f]})
            return f"files changed, added or missing: {', '.join(changed[:5])}"
        return ""

    def artifact(self, key: str) -> dict[str, Any]:
        """What built an entry and its hash (the signed manifest's): for `cuvilctl status`."""
        path = self.entries / key
        try:
            meta = json.loads((path / "meta.json").read_text())
            digest = hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()
        except (OSError, ValueError):
            return {}
        return {"hash": digest[:16], "runtime": meta.get("runtime", ""),
                "runtime_version": meta.get("runtime_version", ""), "verified": True}

    def store(self, key: str, write: Any, meta: dict[str, Any]) -> Path:
        """Call write(tmp_dir) to fill a new entry, then publish it atomically."""
        tmp = Path(tempfile.mkdtemp(dir=self.entries, prefix=".tmp-"))
        try:
            write(tmp)
            (tmp / "meta.json").write_text(json.dumps({**meta, "stored_at": time.time()}))
            files = _file_digests(tmp)
            (tmp / MANIFEST).write_text(json.dumps({"files": files,
                                                    "hmac": self._signature(files)}))
            final = self.entries / key
            with self._lock:
                if final.exists():
                    shutil.rmtree(tmp)
                    return final
                os.replace(tmp, final)
                fsync_dir(self.entries)
            self.evict()
            return final
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def drop(self, key: str) -> None:
        """Remove one entry (it did not load): the next build stores a fresh one."""
        with self._lock:
            shutil.rmtree(self.entries / key, ignore_errors=True)

    def evict(self) -> list[str]:
        """Drop least recently used entries until the cache fits max_bytes."""
        with self._lock:  # (this process's: the workers sharing the directory do not take it)
            sized = []
            for p in self.entries.iterdir():
                if p.name.startswith(".tmp-"):
                    continue  # an entry a worker is writing (`store`)
                try:
                    sized.append(((p / "meta.json").stat().st_mtime, p))
                except OSError:
                    continue  # not an entry, or one another worker dropped or evicted meanwhile
            sized.sort()
            total = sum(_dir_size(p) for _, p in sized)
            dropped = []
            while total > self.max_bytes and sized:
                _, oldest = sized.pop(0)
                total -= _dir_size(oldest)
                shutil.rmtree(oldest, ignore_errors=True)
                dropped.append(oldest.name)
                log.info("compile cache: evicted %s", oldest.name)
            return dropped

    # -- choices -------------------------------------------------------------------------
    def choice(self, part_key: str) -> dict[str, Any] | None:
        path = self.choices / f"{part_key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def record_choice(self, part_key: str, choice: dict[str, Any]) -> None:
        write_atomic(self.choices / f"{part_key}.json", json.dumps(choice, indent=1).encode())

    # -- prior: what past searches on this device said of each runtime -------------------
    def prior_path(self, device: DeviceProfile, precision: str) -> Path:
        """Keyed by the device's digest (kind, name, features, cores), so another machine's
        history, or that of another number of cores, never applies."""
        return self.choices / f"prior-{_key(device_digest(device))[:16]}-{precision}.json"

    def prior(self, device: DeviceProfile, precision: str) -> dict[str, dict[str, Any]]:
        """Per runtime: {"wins": searches won, "ratios": its time / the winner's time in the
        last PRIOR_KEEP searches it ran, "compile_s": its last compile times, "skipped":
        searches it was left out of in a row}. {} when there is none or it does not read: it
        is only a hint, and without it every runtime is tried."""
        try:
            data = json.loads(self.prior_path(device, precision).read_text())
            return {name: {"wins": int(t.get("wins", 0)), "skipped": int(t.get("skipped", 0)),
                           "ratios": [float(r) for r in t.get("ratios", [])],
                           "compile_s": [float(s) for s in t.get("compile_s", [])]}
                    for name, t in data.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def record_search(self, device: DeviceProfile, precision: str,
                      candidates: list[dict[str, Any]], winner: str | None) -> None:
        """Add one finished search (its candidates as recorded in its choice) to the prior.
        Builds in two processes at once may lose one of the two updates: it is only a hint."""
        best = next((c["median_ms"] for c in candidates if c["runtime"] == winner), 0.0)
        with self._lock:
            tally = self.prior(device, precision)
            for c in candidates:
                if c["status"] == "unavailable":
                    continue
                t = tally.setdefault(c["runtime"], {"wins": 0, "skipped": 0, "ratios": [],
                                                    "compile_s": []})
                if c["status"] == "skipped":
                    t["skipped"] += 1
                    continue
                t["skipped"] = 0
                t["wins"] += c["runtime"] == winner
                if best > 0 and c["median_ms"] > 0:  # it ran: how it compared with the winner
                    t["ratios"] = (t["ratios"] + [round(c["median_ms"] / best, 4)])[-PRIOR_KEEP:]
                if not c["cached"] and c["compile_s"] > 0:
                    t["compile_s"] = (t["compile_s"] + [round(c["compile_s"], 3)])[-PRIOR_KEEP:]
            write_atomic(self.prior_path(device, precision),
                         json.dumps(tally, indent=1, sort_keys=True).encode())
