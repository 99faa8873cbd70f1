"""Python client for cuvild's control plane (cuvil.v1)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from cuvild.client.errors import Translated
from cuvild.config import default_socket
from protos import cuvil_pb2, cuvil_pb2_grpc, inference_pb2, inference_pb2_grpc

SYSTEM_SOCKET = "/run/cuvild/cuvild.sock"
CHUNK_BYTES = 1 << 20
POLL_S = 0.1  # how often a waiting load asks the daemon how its model is doing
Progress = Callable[[int, int], None]  # (bytes sent, bytes in all) while uploading
PhaseProgress = Callable[[str], None]  # the model's phase, each time it changes


class LoadFailed(RuntimeError):
    """The model was uploaded (it stays registered) but the daemon could not make it READY.
    The message is the daemon's reason: which part, on which device, and why."""

    def __init__(self, name: str, version: str, reason: str) -> None:
        super().__init__(reason)
        self.name, self.version, self.reason = name, version, reason


def print_progress(sent: int, total: int) -> None:
    """Default progress: one updating line on stderr."""
    end = "\n" if sent >= total else ""
    print(f"\ruploading {sent / 1e6:,.1f} / {total / 1e6:,.1f} MB "
          f"({100 * sent / max(total, 1):.0f}%)", end=end, file=sys.stderr, flush=True)


class PhaseLine:
    """Default phase progress: "loading NAME: PHASE" on one updating line on stderr, ended
    by `done` (padded, since a phase can be shorter than the one before it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.width = 0

    def __call__(self, phase: str) -> None:
        line = f"loading {self.name}: {phase}"
        print(f"\r{line.ljust(self.width)}", end="", file=sys.stderr, flush=True)
        self.width = len(line)

    def done(self) -> None:
        if self.width:
            print(file=sys.stderr, flush=True)


def model_dict(m: cuvil_pb2.ModelSummary) -> dict[str, Any]:
    def specs(items: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in items]

    return {"name": m.name, "version": m.version, "sha256": m.sha256,
            "size_bytes": m.size_bytes, "state": m.state, "created_at": m.created_at,
            "num_nodes": m.num_nodes, "annotated_nodes": m.annotated_nodes,
            "inputs": specs(m.inputs), "outputs": specs(m.outputs),
            "precision": m.precision or "default", "max_error": m.max_error or None,
            "calibration_inputs": m.calibration_inputs,
            "measured_error": m.measured_error if m.measured_error >= 0 else None,
            "phase": m.phase, "warm": m.warm, "load_s": round(m.load_seconds, 3),
            "parts": json.loads(m.parts_json) if m.parts_json else [],
            "batching": {"state": m.batching or None, "max_batch": m.max_batch or None,
                         "max_delay_us": m.max_delay_us or None,
                         "sizes": {int(k): v for k, v in sorted(m.batch_sizes.items())},
                         "requests": m.batched_requests,
                         "queue_ms": {"p50": m.queue_ms_p50, "p99": m.queue_ms_p99}}}


def batching_fields(batching: dict[str, int] | bool | None) -> tuple[int, int]:
    """(max_batch, max_delay_us) for a load's header: 0 takes the daemon's default, a
    max_batch of 1 is off. ValueError names an unknown key."""
    if batching is None or batching is True:
        return 0, 0
    if batching is False:
        return 1, 0
    unknown = set(batching) - {"max_batch", "max_delay_us"}
    if unknown:
        raise ValueError(f"batching: unknown keys {sorted(unknown)}; expected max_batch, "
                         "max_delay_us")
    return int(batching.get("max_batch", 0)), int(batching.get("max_delay_us", 0))


def _digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            digest.update(block)
    return path.stat().st_size, digest.hexdigest()


def save_calibration(path: Path, names: list[str], samples: list[Any]) -> None:
    """Calibration samples as the daemon takes them: an .npz, one array per input name,
    samples stacked along axis 0."""
    import numpy as np
    import torch

    rows = [tuple(s[n] for n in names) if isinstance(s, dict) and set(s) == set(names)
            else s if isinstance(s, (tuple, list)) else (s,) for s in samples]
    if not rows or any(len(r) != len(names) for r in rows):
        raise ValueError(f"calibration: each sample must hold the model's {len(names)} "
                         f"input(s) {names}")
    arrays = {}
    for i, name in enumerate(names):
        arrays[name] = np.stack([(r[i].detach().cpu().numpy() if isinstance(r[i], torch.Tensor)
                                  else np.asarray(r[i])) for r in rows])
    np.savez(path, **arrays)


def default_target() -> str:
    """$CUVIL_TARGET, else the systemd service's socket if present, else this user's."""
    if os.environ.get("CUVIL_TARGET"):
        return os.environ["CUVIL_TARGET"]
    if Path(SYSTEM_SOCKET).exists():
        return f"unix://{SYSTEM_SOCKET}"
    return f"unix://{default_socket()}"


def profile_dict(dev: cuvil_pb2.DeviceProfile) -> dict[str, Any]:
    """The stable JSON shape of a device: the same keys as partitioner.profile.DeviceProfile."""
    return {
        "id": dev.id, "kind": dev.kind, "name": dev.name, "emulated": dev.emulated,
        "memory_gb": dev.memory_gb, "peak_gflops": dict(sorted(dev.peak_gflops.items())),
        "mem_bw_gbs": dev.mem_bw_gbs, "link_bw_gbs": dev.link_bw_gbs,
        "link_latency_us": dev.link_latency_us, "launch_us": dev.launch_us,
        "runtimes": list(dev.runtimes), "cores": list(dev.cores), "features": list(dev.features),
        "efficiency": dict(sorted(dev.efficiency.items())),
    }


class Client:
    """A connection to one cuvild. `target` is `unix:///path/to.sock` or `host:port`.
    fast=True (or a `unix+fast://` target) runs `infer` on the same-host fast path
    (cuvild/client/fast.py): a session per thread and model, no gRPC per request."""

    def __init__(self, target: str | None = None, timeout: float = 30.0,
                 fast: bool = False) -> None:
        target = target or default_target()
        if target.startswith("unix+fast:"):
            target, fast = "unix:" + target.removeprefix("unix+fast:"), True
        if fast and not target.startswith("unix:"):
            raise ValueError(f"the fast path runs on the daemon's unix socket, not {target}")
        self.target, self.fast = target, fast
        self.timeout = timeout
        self._sessions = threading.local()  # fast path: this thread's session per model
        self._every_session: list[Any] = []  # every thread's, for close()
        self._sessions_lock = threading.Lock()
        self._channel = grpc.insecure_channel(self.target)
        # every call raises CuvildError (cuvild/client/errors.py), never a raw grpc.RpcError
        self._control = Translated(cuvil_pb2_grpc.ControlStub(self._channel), self.target)
        self._infer = Translated(inference_pb2_grpc.GRPCInferenceServiceStub(self._channel),
                                 self.target)
        self._region: Any = None  # cuvild.client.infer_io.ClientRegion, made on first shm request
        self._metadata: dict[str, dict[str, Any]] = {}
        self._containers: dict[tuple[str, str], tuple[Any, list[str]]] = {}

    def close(self) -> None:
        with self._sessions_lock:
            sessions, self._every_session = self._every_session, []
        for session in sessions:  # every thread's: a pool's threads outlive the client
            session.close()
        if self._region is not None:
            self._region.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status(self) -> dict[str, Any]:
        """Daemon version, uptime, devices with their profiles, loaded models."""
        r = self._control.GetStatus(cuvil_pb2.GetStatusRequest(), timeout=self.timeout)
        return {
            "version": r.version,
            "pid": r.pid,
            "uptime_s": round(r.uptime_s, 3),
            "config": r.config_path,
            "profile": {"source": r.profile_source, "seconds": round(r.profile_seconds, 3),
                        "fingerprint": r.fingerprint},
            "devices": [profile_dict(d) for d in r.devices],
            "models": [model_dict(m) for m in r.models],
            "repository_refused": [{"name": e.name, "version": e.version, "reason": e.reason}
                                   for e in r.repository_refused],
        }

    def profile(self, refresh: bool = False, timeout: float = 600.0) -> dict[str, Any]:
        """Device profiles; refresh=True re-measures them (seconds to minutes)."""
        r = self._control.ProfileDevices(cuvil_pb2.ProfileDevicesRequest(refresh=refresh),
                                         timeout=timeout)
        return {
            "profile": {"source": r.profile_source, "seconds": round(r.profile_seconds, 3),
                        "fingerprint": r.fingerprint},
            "devices": [profile_dict(d) for d in r.devices],
        }

    # -- models ----------------------------------------------------------------------------
    def load_file(self, name: str, path: str | os.PathLike[str], version: str | None = None,
                  replace: bool = False, progress: Progress | bool | None = None,
                  timeout: float = 600.0, precision: str | None = None,
                  max_error: float | None = None,
                  calibration: str | os.PathLike[str] | None = None, wait: bool = True,
                  on_phase: PhaseProgress | None = None,
                  batching: dict[str, int] | bool | None = None) -> dict[str, Any]:
        """Upload a .pt2 archive saved by torch.export.save (or cuvild.export + save).

        `precision`: "fp32" (exact) or "auto" (the fastest plan whose outputs stay within
        `max_error` of torch eager fp32); None takes the daemon's default. `calibration`: an
        .npz with one array per model input name, samples along axis 0 (int8 needs it).
        `batching`: {"max_batch": 8, "max_delay_us": 500} merges concurrent requests of a
        model whose first dimension is dynamic into one run (docs/BATCHING.md); False turns
        it off; None or a missing key takes the daemon's engine.batching.

        wait=True (the default) returns once the model is READY, so the next infer runs;
        LoadFailed if the daemon could not build it, TimeoutError if upload and build take
        more than `timeout` seconds (see `wait_ready`). wait=False returns once the daemon
        has the archive, while it still loads ("state": "loading"). `progress`: a
        callable(sent, total) told of the upload, or True for lines on stderr (upload, then
        the model's phase); `on_phase`: a callable told each phase while waiting."""
        t0 = time.monotonic()
        path = Path(path)
        size, digest = _digest(path)
        cal_size, cal_digest = _digest(Path(calibration)) if calibration else (0, "")
        report = print_progress if progress is True else progress or None
        max_batch, max_delay_us = batching_fields(batching)

        def requests() -> Iterator[cuvil_pb2.LoadModelRequest]:
            yield cuvil_pb2.LoadModelRequest(header=cuvil_pb2.LoadModelHeader(
                name=name, version=version or "", sha256=digest, size_bytes=size,
                replace=replace, precision=precision or "", max_error=max_error or 0.0,
                calibration_bytes=cal_size, calibration_sha256=cal_digest,
                max_batch=max_batch, max_delay_us=max_delay_us))
            sent = 0
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(CHUNK_BYTES), b""):
                    yield cuvil_pb2.LoadModelRequest(chunk=block)
                    sent += len(block)
                    if report:
                        report(sent, size)
            if calibration:
                with open(calibration, "rb") as f:
                    for block in iter(lambda: f.read(CHUNK_BYTES), b""):
                        yield cuvil_pb2.LoadModelRequest(calibration_chunk=block)

        r = self._control.LoadModel(requests(), timeout=timeout)
        model, waited = model_dict(r.model), 0.0
        if wait:
            t1 = time.monotonic()
            model = self.wait_ready(name, r.model.version, timeout - (t1 - t0),
                                    on_phase or (PhaseLine(name) if progress is True else None))
            waited = time.monotonic() - t1
        return {"model": model, "already_present": r.already_present, "seconds": r.seconds,
                "state": model["state"], "phase": model["phase"], "wait_s": round(waited, 3)}

    def wait_ready(self, name: str, version: str | None = None, timeout: float = 600.0,
                   on_phase: PhaseProgress | None = None) -> dict[str, Any]:
        """Wait while model `name` (its newest version unless `version`) is loading and
        return its summary once READY. Raises LoadFailed with the daemon's reason when it
        could not be built, and TimeoutError after `timeout` seconds naming the phase it was
        in (the daemon goes on loading it). `on_phase` is told each new phase."""
        deadline = time.monotonic() + timeout
        phase = None
        try:
            while True:
                model = self._find_model(name, version)
                if on_phase and model["phase"] and model["phase"] != phase:
                    on_phase(model["phase"])
                phase = model["phase"]
                if model["state"] != "loading":
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"model {name}:{model['version']} still loading after "
                                       f"waiting {timeout:.1f} s (phase: "
                                       f"{phase or 'unknown'}); cuvild goes on loading it")
                time.sleep(min(POLL_S, left))
        finally:
            if isinstance(on_phase, PhaseLine):
                on_phase.done()
        if model["state"].startswith("unavailable"):
            reason = model["state"].partition(": ")[2] or "unavailable"
            raise LoadFailed(name, model["version"], reason)
        return model

    def _find_model(self, name: str, version: str | None) -> dict[str, Any]:
        found = [m for m in self.models()
                 if m["name"] == name and (not version or m["version"] == version)]
        if not found:
            label = f"{name}:{version}" if version else name
            raise LoadFailed(name, version or "", f"model {label} is not registered (unloaded "
                                                   "while it loaded?)")
        return max(found, key=lambda m: m["created_at"])

    def load(self, name: str, model: Any, example_inputs: tuple[Any, ...] = (),
             dynamic_shapes: Any = None, version: str | None = None, replace: bool = False,
             progress: Progress | bool | None = None, precision: str | None = None,
             max_error: float | None = None, calibration: list[Any] | None = None,
             wait: bool = True, timeout: float = 600.0,
             on_phase: PhaseProgress | None = None,
             batching: dict[str, int] | bool | None = None,
             kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Export `model` with its @partition annotations and upload it, with a precision
        policy. Inputs are `example_inputs` (positional) and `kwargs` (keyword, as
        torch.export takes them: `kwargs={"input_ids": ids, "attention_mask": mask}`); the
        model's inputs are named after its forward's arguments. `calibration` is a list of
        samples, each the model's inputs (a tensor, a tuple of tensors in the model's order
        or a dict by input name). Waits until READY unless wait=False: see `load_file` for
        that, `progress`, `on_phase`, `timeout` and `batching` (which needs a dynamic first
        dimension: `dynamic_shapes`)."""
        import torch

        from partitioner.annotate import export

        program = export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes,
                         kwargs=kwargs)
        with tempfile.TemporaryDirectory(prefix="cuvil-upload-") as tmp:
            path = Path(tmp) / f"{name}.pt2"
            torch.export.save(program, path)
            npz = None
            if calibration is not None:
                names = list(program.graph_signature.user_inputs)
                npz = Path(tmp) / "calibration.npz"
                save_calibration(npz, names, calibration)
            return self.load_file(name, path, version=version, replace=replace,
                                  progress=progress, timeout=timeout, precision=precision,
                                  max_error=max_error, calibration=npz, wait=wait,
                                  on_phase=on_phase, batching=batching)

    def compare(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Latency and accuracy of a served model: torch eager fp32, the fp32 plan and the
        plan chosen under its precision policy, and every part's candidates."""
        import json

        r = self._control.Compare(cuvil_pb2.CompareRequest(name=name, version=version or ""),
                                  timeout=self.timeout)
        return json.loads(r.report_json)

    def stats(self, interval: float = 1.0) -> dict[str, Any]:
        """What a person checks first: per model the request rate, p50/p99 of the recent
        requests and errors (a language model's: its tokens a second, and p50/p99 of the
        time to a generation's first token and between tokens after it); per device how
        busy it was; over `interval` seconds. `loads`:
        what the daemon's loads did since it started (archives read, plans made, parts
        built, compiled, and restored from load records)."""
        import json
        import time

        def snapshot() -> dict[str, Any]:
            r = self._control.GetStats(cuvil_pb2.GetStatsRequest(), timeout=self.timeout)
            return json.loads(r.stats_json)

        first = snapshot()
        time.sleep(interval)
        last = snapshot()
        span = max(last["at"] - first["at"], 1e-9)
        models = {}
        for key, now in last["models"].items():
            then = first["models"].get(key, {"success": 0, "failure": 0, "inferences": 0})
            done = now["success"] + now["failure"] - then["success"] - then["failure"]
            models[key] = {"requests_per_s": done / span,
                           "errors_per_s": (now["failure"] - then["failure"]) / span,
                           "success": now["success"], "failure": now["failure"],
                           "inferences": now["inferences"],
                           "latency_ms": now.get("latency_ms"),
                           # fast-path requests a worker ran: bucket bounds (at most), since
                           # the daemon started
                           "fast_latency_ms": now.get("fast_latency_ms")}
            if "tokens" in now:  # a language model's generations: tokens, first and after
                models[key].update(
                    tokens=now["tokens"],
                    tokens_per_s=(now["tokens"] - then.get("tokens", 0)) / span,
                    first_token_ms=now.get("first_token_ms"),
                    inter_token_ms=now.get("inter_token_ms"))
        devices = {d: (busy - first["devices"].get(d, 0.0)) / span
                   for d, busy in last["devices"].items()}
        return {"interval_s": span, "models": models, "devices_busy": devices,
                "loads": last.get("loads", {})}

    def reload(self, timeout: float = 120.0) -> dict[str, Any]:
        """Have the daemon read its config file (and model repository) again, as SIGHUP or
        `systemctl reload cuvild` do; returns once done: {"ok", "error", "config_path",
        "on_restart": keys that changed but take effect on the next start}."""
        r = self._control.Reload(cuvil_pb2.ReloadRequest(), timeout=timeout)
        return {"ok": r.ok, "error": r.error or None, "config_path": r.config_path,
                "on_restart": list(r.on_restart)}

    def models(self) -> list[dict[str, Any]]:
        r = self._control.ListModels(cuvil_pb2.ListModelsRequest(), timeout=self.timeout)
        return [model_dict(m) for m in r.models]

    def unload(self, name: str, version: str | None = None) -> list[dict[str, Any]]:
        r = self._control.UnloadModel(
            cuvil_pb2.UnloadModelRequest(name=name, version=version or ""), timeout=self.timeout)
        return [model_dict(m) for m in r.removed]

    def plan(self, name: str, version: str | None = None, replan: bool = False,
             objective: str = "latency") -> dict[str, Any]:
        """The plan a served model runs with, or (replan=True) a fresh one."""
        import json

        r = self._control.GetPlan(cuvil_pb2.GetPlanRequest(
            name=name, version=version or "", replan=replan, objective=objective),
            timeout=max(self.timeout, 120.0))
        return {"plan": json.loads(r.plan_json), "explain": r.explain,
                "measured": json.loads(r.measured_json or "{}"), "dot": r.dot}

    def generate(self, name: str, prompt: Sequence[int] | None = None, *,
                 text: str | None = None, max_tokens: int = 16, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[int] = (), version: str | None = None,
                 timeout: float | None = None,
                 messages: Sequence[Mapping[str, str]] | None = None,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 logit_bias: Mapping[int, float] | None = None, ignore_eos: bool = False,
                 structured: Mapping[str, Any] | None = None,
                 repetition_penalty: float = 1.0, min_p: float = 0.0, min_tokens: int = 0,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 continue_final_message: bool = False,
                 ) -> Iterator[dict[str, Any]]:
        """A language model's tokens as they come: {"token_id", "text", "index"} each (`text`
        is what the token adds, with the model's tokenizer; "" without one). `prompt`: token
        ids, or `text` for a model with a tokenizer; temperature 0 is greedy, `seed` makes
        sampling repeatable, `stop` token ids end it, as the model's end-of-sequence tokens
        do unless `ignore_eos`; `frequency_penalty`, `presence_penalty` and `logit_bias`
        ({token id: bias}) are OpenAI's (docs/GENERATION.md); `structured` holds the output
        to a grammar: {"json": a JSON schema}, {"json_object": True}, {"regex": ...},
        {"choice": [...]} or {"grammar": a Lark or GBNF grammar}; `repetition_penalty`,
        `min_p` and `min_tokens` are vLLM's. `messages` (a chat: [{"role",
        "content"}, ...], as OpenAI's) instead of a prompt: put in the prompt by the model's
        chat template, given `chat_template_kwargs` too (vLLM's: Qwen3's {"enable_thinking":
        False}); `continue_final_message`: the answer goes on with the last message, an
        assistant's, instead of beginning one. Leaving the loop early ends the generation
        in the daemon."""
        import grpc

        from cuvild.client.errors import from_rpc

        request = cuvil_pb2.GenerateRequest(
            name=name, version=version or "", input_ids=list(prompt or ()), text=text or "",
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            stop=list(stop), messages=[cuvil_pb2.ChatMessage(role=m["role"],
                                                             content=m["content"])
                                       for m in messages or ()],
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            logit_bias=dict(logit_bias or {}), ignore_eos=ignore_eos,
            structured=json.dumps(structured) if structured is not None else "",
            repetition_penalty=repetition_penalty, min_p=min_p, min_tokens=min_tokens)
        if chat_template_kwargs or continue_final_message:
            request.chat_options = json.dumps({
                "chat_template_kwargs": dict(chat_template_kwargs or {}),
                "continue_final_message": continue_final_message,
                "add_generation_prompt": not continue_final_message})
        if seed is not None:
            request.seed = seed
        stream = self._control._stub.Generate(request, timeout=timeout)  # noqa: SLF001 - a server stream: its errors come as it is read
        try:
            for r in stream:
                yield {"token_id": r.token_id, "text": r.text, "index": r.index}
        except grpc.RpcError as e:
            raise from_rpc(e, self.target) from None
        finally:
            stream.cancel()

    # -- inference (Open Inference Protocol) -----------------------------------------------
    def metadata(self, name: str) -> dict[str, Any]:
        r = self._infer.ModelMetadata(inference_pb2.ModelMetadataRequest(name=name),
                                      timeout=self.timeout)
        return {"name": r.name, "versions": list(r.versions),
                "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                           for t in r.inputs],
                "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                            for t in r.outputs]}

    def infer(self, name: str, inputs: Any, shm: bool = False,
              version: str | None = None) -> dict[str, Any]:
        """Run a model. `inputs`: a tensor, a sequence in the model's order, or a dict by
        input name. Returns {output name: torch tensor}, or the model's own container (a
        transformers ModelOutput, a registered dataclass) when its class is registered with
        torch's pytree in this process (cuvild/client/trees.py). shm=True passes inputs and
        outputs through a shared-memory region instead of the gRPC message. On the fast path
        (Client(fast=True)) errors are FastPathError, with the same status names."""
        from cuvild.client.trees import positional, rebuild

        outputs = self._infer_dict(name, inputs, shm, version or "")
        if positional(outputs):  # a tuple or a lone tensor: the dict is the answer
            return outputs
        spec, names = self._container(name, version or "")
        return rebuild(spec, names, outputs)

    def _container(self, name: str, version: str) -> tuple[Any, list[str]]:
        """The TreeSpec a model's outputs are rebuilt with (None: a dict by name) and the
        names of its outputs, once per model and version (a ListModels call: on the fast
        path too, the one gRPC call it makes, and only for outputs named by field)."""
        key = (name, version)
        if key not in self._containers:
            from cuvild.client.trees import container_spec

            r = self._control.ListModels(cuvil_pb2.ListModelsRequest(), timeout=self.timeout)
            found = [m for m in r.models if m.name == name and version in ("", m.version)]
            if not found:
                return None, []
            latest = max(found, key=lambda m: m.created_at)
            self._containers[key] = (container_spec(latest.out_spec),
                                     [t.name for t in latest.outputs])
        return self._containers[key]

    def _infer_dict(self, name: str, inputs: Any, shm: bool, version: str) -> dict[str, Any]:
        from cuvild.client.infer_io import ClientRegion, run_infer

        if self.fast:
            return self._fast_infer(name, inputs, version)
        if name not in self._metadata:
            self._metadata[name] = self.metadata(name)
        if shm and self._region is None:
            unix = self.target.removeprefix("unix://").removeprefix("unix:")
            self._region = ClientRegion(self._infer, self.timeout,
                                        unix if self.target.startswith("unix") else None)
        return run_infer(self._infer, name, inputs, self._region if shm else None,
                         version=version or "", metadata=self._metadata[name],
                         timeout=self.timeout)

    def session(self, name: str, version: str = "") -> Any:
        """This thread's fast-path session on model `name` (opened on first use)."""
        from cuvild.client.fast import FastSession

        sessions = getattr(self._sessions, "open", None)
        if sessions is None:
            sessions = self._sessions.open = {}
        session = sessions.get((name, version))
        if session is None:
            path = self.target.removeprefix("unix://").removeprefix("unix:")
            session = sessions[(name, version)] = FastSession(path, name, version,
                                                              timeout=self.timeout)
            with self._sessions_lock:
                self._every_session.append(session)
        return session

    def _fast_infer(self, name: str, inputs: Any, version: str) -> dict[str, Any]:
        import torch

        session = self.session(name, version)
        outputs = session.run(inputs)
        return {spec["name"]: torch.from_numpy(out) if isinstance(out, np.ndarray) else out
                for spec, out in zip(session.outputs, outputs, strict=True)}
