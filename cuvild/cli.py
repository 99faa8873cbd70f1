"""cuvilctl: talk to a running cuvild.

Human output is a table; --json prints a stable document for scripts. A daemon that cannot be
reached is a one-line error and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import grpc

from cuvild.client import Client, default_target

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
    if not models:
        print("models: none loaded")
    else:
        print(format_table(["MODEL", "VERSION", "STATE", "SIZE MB", "SHA256"],
                           [[m["name"], m["version"], m["state"],
                             _num(m["size_bytes"] / 1e6), m["sha256"][:12]] for m in models]))


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    status = client.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print_status(status)
    return 0


def cmd_profile(client: Client, args: argparse.Namespace) -> int:
    if args.refresh and not args.json:
        print("re-measuring devices (this takes a few seconds)...", file=sys.stderr)
    result = client.profile(refresh=args.refresh)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        prof = result["profile"]
        print(f"device profiles: {prof['source']} ({prof['seconds']:.2f} s), "
              f"fingerprint {prof['fingerprint']}\n")
        print(devices_table(result["devices"]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuvilctl", description="Control a running cuvild.")
    parser.add_argument("--target", default=None,
                        help=f"daemon address, unix:///path.sock or host:port "
                             f"(default: $CUVIL_TARGET or {default_target()})")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="devices, their measured profiles, loaded models")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)
    profile = sub.add_parser("profile", help="show or re-measure device profiles")
    profile.add_argument("--refresh", action="store_true", help="re-run the micro-benchmarks")
    profile.add_argument("--json", action="store_true", help="machine-readable output")
    profile.set_defaults(func=cmd_profile)
    return parser


def _rpc_error(target: str, err: grpc.RpcError) -> str:
    code = err.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"cannot reach cuvild at {target} ({code.name.lower()}); is it running?"
    return f"{code.name}: {err.details()}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[Client, argparse.Namespace], int] = args.func
    client = Client(args.target, timeout=args.timeout)
    try:
        return func(client, args)
    except grpc.RpcError as err:
        print(f"cuvilctl: {_rpc_error(client.target, err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()
