"""What Triton's ModelConfig and ModelStatistics calls answer for a served model.

tritonclient's `get_model_config` / `get_inference_statistics`, perf_analyzer and model
analyzer ask these first. The configuration is what cuvild serves, in Triton's words: the
inputs and outputs, `max_batch_size` and `dynamic_batching` where concurrent requests are
merged (then, as in Triton, dims leave out the batch dimension), one instance group of kind
KIND_MODEL (the model's parts place themselves, across devices). The statistics come from the
daemon's metrics (cuvild/serve/metrics.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cuvild.core.dtypes import oip_name
from protos import inference_pb2 as pb

if TYPE_CHECKING:
    from cuvild.load.models import ServedModel
    from cuvild.serve.metrics import Metrics

PLATFORM = "pytorch_torch_export"


def _data_type(dtype: str) -> int:
    """Triton's DataType for a torch dtype name (TYPE_INVALID where it has none)."""
    oip = oip_name(dtype)
    name = "TYPE_STRING" if oip == "BYTES" else f"TYPE_{oip}"
    return pb.DataType.Value(name) if name in pb.DataType.keys() else pb.TYPE_INVALID


def model_config(served: ServedModel) -> Any:
    """The ModelConfig of a served model (READY or not: what it was registered with)."""
    batcher = served.loaded.batcher if served.loaded is not None else None
    max_batch = batcher.settings.max_batch if batcher is not None else 0
    config = pb.ModelConfig(name=served.record.name, platform=PLATFORM, backend="cuvild",
                            max_batch_size=max_batch)
    for spec in served.record.inputs:
        config.input.add(name=spec["name"], data_type=_data_type(spec["dtype"]),
                         dims=spec["shape"][1:] if max_batch else spec["shape"])
    for spec in served.record.outputs:
        config.output.add(name=spec["name"], data_type=_data_type(spec["dtype"]),
                          dims=spec["shape"][1:] if max_batch else spec["shape"])
    devices = sorted(served.loaded.parts_by_device) if served.loaded is not None else []
    config.instance_group.add(name="+".join(devices) or served.record.name, count=1,
                              kind=pb.ModelInstanceGroup.KIND_MODEL)
    if batcher is not None:
        config.dynamic_batching.max_queue_delay_microseconds = batcher.settings.max_delay_us
    return config


def config_json(config: Any) -> dict[str, Any]:
    """The ModelConfig as Triton's HTTP endpoint writes it (field names as in the proto,
    enums by name, numbers as numbers)."""
    doc: dict[str, Any] = {
        "name": config.name, "platform": config.platform, "backend": config.backend,
        "max_batch_size": config.max_batch_size,
        "input": [{"name": t.name, "data_type": pb.DataType.Name(t.data_type),
                   "dims": list(t.dims)} for t in config.input],
        "output": [{"name": t.name, "data_type": pb.DataType.Name(t.data_type),
                    "dims": list(t.dims)} for t in config.output],
        "instance_group": [{"name": g.name, "count": g.count,
                            "kind": pb.ModelInstanceGroup.Kind.Name(g.kind)}
                           for g in config.instance_group]}
    if config.HasField("dynamic_batching"):
        doc["dynamic_batching"] = {"max_queue_delay_microseconds":
                                   config.dynamic_batching.max_queue_delay_microseconds}
    return doc


def model_statistics(metrics: Metrics | None, served: ServedModel) -> Any:
    """The ModelStatistics of a served model: zeros where metrics are off."""
    name, version = served.record.name, served.record.version
    stats = pb.ModelStatistics(name=name, version=version)
    if metrics is None:
        return stats
    figures = metrics.statistics(name, version)
    for field in ("success", "fail", "queue", "compute_infer"):
        count, seconds = figures[field]
        duration = getattr(stats.inference_stats, field)
        duration.count, duration.ns = int(count), int(seconds * 1e9)
    stats.inference_count = int(figures["inference_count"])
    stats.execution_count = int(figures["execution_count"])
    stats.last_inference = int(figures["last_inference"] * 1e3)
    return stats


def statistics_json(stats: Any) -> dict[str, Any]:
    """A ModelStatistics as Triton's HTTP endpoint writes it."""
    durations = ("success", "fail", "queue", "compute_input", "compute_infer",
                 "compute_output")
    return {"name": stats.name, "version": stats.version,
            "last_inference": stats.last_inference,
            "inference_count": stats.inference_count,
            "execution_count": stats.execution_count,
            "inference_stats": {f: {"count": getattr(stats.inference_stats, f).count,
                                    "ns": getattr(stats.inference_stats, f).ns}
                                for f in durations},
            "batch_stats": []}
