"""How cuvilctl shows what the daemon says of itself: its devices' profiles and its models
as tables (`cuvilctl status`, `profile`, `models`, the demo)."""

from __future__ import annotations

from typing import Any

DTYPE_COLUMNS = ("fp32", "bf16", "fp16", "int8")


def _num(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}" if value else "-"


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [headers, *rows]]
    return "\n".join(lines)


def devices_table(devices: list[dict[str, Any]]) -> str:
    headers = ["DEVICE", "KIND", "EMULATED", *(f"{d.upper()} GFLOP/s" for d in DTYPE_COLUMNS),
               "MEM GB/s", "LINK GB/s", "LINK us", "LAUNCH us", "MEMORY GB", "CORES", "RUNTIMES"]
    rows = []
    for d in devices:
        peak = d["peak_gflops"]
        rows.append([
            d["id"], d["kind"], "yes" if d["emulated"] else "no",
            *(_num(peak.get(k, 0.0)) for k in DTYPE_COLUMNS),
            _num(d["mem_bw_gbs"]), _num(d["link_bw_gbs"]), _num(d["link_latency_us"], 2),
            _num(d["launch_us"], 2), _num(d["memory_gb"]),
            ",".join(map(str, d["cores"])) or "-", ",".join(d["runtimes"]) or "-",
        ])
    names = "\n".join(f"  {d['id']}: {d['name']}" for d in devices)
    return format_table(headers, rows) + "\n" + names


def models_table(models: list[dict[str, Any]]) -> str:
    def shapes(specs: list[dict[str, Any]]) -> str:
        return " ".join(f"{t['name']}:{t['dtype']}{t['shape']}" for t in specs)

    def policy(m: dict[str, Any]) -> str:
        budget = f" {m['max_error']:.2g}" if m["precision"] == "auto" and m["max_error"] else ""
        return m["precision"] + budget

    def error(m: dict[str, Any]) -> str:
        return "-" if m["measured_error"] is None else f"{m['measured_error']:.1e}"

    def phase(m: dict[str, Any]) -> str:
        return (m.get("phase") or "-") + (", warm" if m.get("warm") else "")

    table = format_table(
        ["MODEL", "VERSION", "STATE", "PHASE", "PRECISION", "ERROR", "SIZE MB", "NODES",
         "ANNOTATED", "SHA256", "INPUTS"],
        [[m["name"], m["version"], m["state"].split(":")[0], phase(m), policy(m), error(m),
          _num(m["size_bytes"] / 1e6), str(m["num_nodes"]), str(m["annotated_nodes"]),
          m["sha256"][:12], shapes(m["inputs"])] for m in models])
    # a failed model's reason is too long for a column, and the first thing its owner needs
    failed = [f"  {m['name']}:{m['version']} {m['state']}" for m in models
              if m["state"].startswith("unavailable")]
    return "\n".join([table, *failed, *filter(None, map(batching_line, models))])


def batching_line(m: dict[str, Any]) -> str:
    """A served model's batching: its settings, the batch sizes run and the queue wait."""
    b = m.get("batching") or {}
    if not b.get("state") or b["state"] == "off":
        return ""
    where = f"  {m['name']}:{m['version']} batching {b['state']}"
    if b["state"] != "on":
        return where
    sizes = " ".join(f"{k}x{v}" for k, v in b["sizes"].items()) or "none yet"
    return (f"{where}: max_batch {b['max_batch']}, max_delay {b['max_delay_us']} us; "
            f"{b['requests']} requests, runs by rows {sizes}; queue wait p50 "
            f"{b['queue_ms']['p50']:.2f} ms, p99 {b['queue_ms']['p99']:.2f} ms")


def print_status(status: dict[str, Any]) -> None:
    prof = status["profile"]
    print(f"cuvild {status['version']}  pid {status['pid']}  up {status['uptime_s']:.1f} s  "
          f"config {status['config']}")
    print(f"device profiles: {prof['source']} ({prof['seconds']:.2f} s), "
          f"fingerprint {prof['fingerprint']}")
    print()
    print(devices_table(status["devices"]))
    print()
    models = status["models"]
    print(models_table(models) if models else "models: none loaded")
    refused = status.get("repository_refused") or []
    if refused:
        print(f"\nmodel repository: {len(refused)} entr{'y' if len(refused) == 1 else 'ies'} "
              "not served")
        for e in refused:
            print(f"  {e['name']}{':' + e['version'] if e['version'] else ''}: {e['reason']}")
