"""cuvilctl: talk to a running cuvild.

Human output is a table; --json prints a stable document for scripts. A daemon that cannot be
reached is a one-line error and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cuvild.client import Client, LoadFailed, default_target
from cuvild.client.cli_generate import add_generate
from cuvild.client.errors import CuvildError
from cuvild.client.export_encoder import add_export_encoder
from cuvild.client.export_lm import add_export_lm
from cuvild.client.tables import devices_table, format_table, models_table, print_status
from partitioner.phases import GENERATED, PROMPT


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


def cmd_load(client: Client, args: argparse.Namespace) -> int:
    if not Path(args.file).is_file():
        print(f"cuvilctl: {args.file}: no such file", file=sys.stderr)
        return 1
    if args.calibration and not Path(args.calibration).is_file():
        print(f"cuvilctl: --calibration {args.calibration}: no such file", file=sys.stderr)
        return 1
    try:
        result = client.load_file(args.name, args.file, version=args.version,
                                  replace=args.replace,
                                  progress=not args.json and sys.stderr.isatty() or None,
                                  timeout=args.wait_timeout, precision=args.precision,
                                  max_error=args.max_error, calibration=args.calibration,
                                  wait=not args.no_wait,
                                  batching={"max_batch": args.max_batch or 0,
                                            "max_delay_us": args.max_delay_us or 0},
                                  # --json: each phase a JSON line on stderr, for scripts
                                  on_phase=(lambda phase: print(json.dumps(
                                      {"model": args.name, "phase": phase}), file=sys.stderr,
                                      flush=True)) if args.json else None)
    except LoadFailed as e:
        print(f"cuvilctl: {args.name} version {e.version} failed to load: {e}",
              file=sys.stderr)
        return 1
    except TimeoutError as e:
        print(f"cuvilctl: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(load_text(result))
    return 0


def load_text(result: dict[str, Any]) -> str:
    m = result["model"]
    how = "already registered" if result["already_present"] else "registered"
    lines = [f"{m['name']} version {m['version']} {how}: {m['num_nodes']} nodes "
             f"({m['annotated_nodes']} annotated), sha256 {m['sha256'][:12]}, "
             f"{result['seconds']:.2f} s"]
    if result["state"] == "ready":
        warm = " (from its load record)" if m["warm"] else ""
        lines.append(f"{m['name']} version {m['version']} ready{warm}: built in "
                     f"{m['load_s']:.2f} s, waited {result['wait_s']:.2f} s")
    elif result["state"] == "loading":
        lines.append(f"{m['name']} version {m['version']} loading ({result['phase'] or 'queued'})"
                     f"; `cuvilctl status` shows its phase")
    return "\n".join(lines)


def cmd_models(client: Client, args: argparse.Namespace) -> int:
    models = client.models()
    if args.json:
        print(json.dumps(models, indent=2))
    else:
        print(models_table(models) if models else "no models registered")
    return 0


def cmd_unload(client: Client, args: argparse.Namespace) -> int:
    removed = client.unload(args.name, args.version)
    if args.json:
        print(json.dumps(removed, indent=2))
    else:
        for m in removed:
            print(f"unloaded {m['name']} version {m['version']}")
    return 0


def positive(text: str) -> int:
    """An argparse type: a whole number above zero."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}")
    return value


def _plan_offline(args: argparse.Namespace, client: Client) -> dict[str, Any]:
    from cuvild.intake.safe_load import DEFAULT_MAX_BYTES, load_exported_program
    from partitioner import report
    from partitioner.phases import Generation
    from partitioner.plan import plan_model
    from partitioner.profile import DeviceProfile, load_profiles

    if args.profile:
        devices = load_profiles(args.profile)
    else:  # the host's measured devices, from the daemon
        devices = [DeviceProfile.from_dict(d) for d in client.profile()["devices"]]
    # (the caller's own file, read here: the safe loader still, its size the only bound)
    most = max(DEFAULT_MAX_BYTES, 2 * Path(args.model).stat().st_size)
    plan = plan_model(load_exported_program(args.model, max_bytes=most), devices,
                      objective=args.objective,
                      generation=Generation(args.prompt_tokens or PROMPT,
                                            args.generated_tokens or GENERATED))
    return {"plan": plan.to_dict(), "explain": report.explain(plan), "measured": {},
            "dot": report.to_dot(plan)}


def cmd_partition(client: Client, args: argparse.Namespace) -> int:
    from partitioner.cost import PlacementError

    try:
        if Path(args.model).is_file():
            result = _plan_offline(args, client)
        elif args.profile or args.prompt_tokens or args.generated_tokens:
            given = "--profile" if args.profile else "--prompt-tokens/--generated-tokens"
            print(f"cuvilctl: {args.model}: no such file ({given}: for a .pt2 file)",
                  file=sys.stderr)
            return 1
        else:  # a model the daemon serves
            result = client.plan(args.model, replan=args.replan, objective=args.objective)
            if args.replan:
                result["served"] = client.plan(args.model)
    except (PlacementError, ValueError) as e:
        print(f"cuvilctl: cannot plan {args.model}: {e}", file=sys.stderr)
        return 1
    if args.dot:
        Path(args.dot).write_text(result["dot"])
    if args.svg:
        from partitioner.picture import to_svg
        from partitioner.plan import Plan

        Path(args.svg).write_text(to_svg(Plan.from_dict(result["plan"]), result["measured"]))
    if args.json:
        print(json.dumps({k: result[k] for k in ("plan", "measured", "served") if k in result},
                         indent=2))
        return 0
    print(result["explain"])
    if "served" in result:
        print()
        print(replan_difference(result["served"], result["plan"]))
    if result["measured"]:
        print()
        print(format_table(["PART", "DEVICE", "RUNTIME", "PREDICTED ms", "MEASURED ms"],
                           [[pid, m["device"], m["runtime"], f"{m['predicted_ms']:.2f}",
                             measured_cell(m)] for pid, m in result["measured"].items()]))
    return 0


def measured_cell(m: dict[str, Any]) -> str:
    """A part's measured median; a dynamic-shape model's at the input shapes served last."""
    if m["measured_ms"] is None:
        return "-"
    at = ", ".join("x".join(map(str, s)) for s in m.get("shapes", []))
    return f"{m['measured_ms']:.2f}" + (f" at {at}" if at else "")


def replan_difference(served: dict[str, Any], plan: dict[str, Any]) -> str:
    """How a re-plan with measured costs differs from the plan being served."""
    def placement(p: dict[str, Any]) -> dict[str, str]:
        return {n: part["device"] for part in p["parts"] for n in part["nodes"]}

    before, after = placement(served["plan"]), placement(plan)
    moved = [n for n in after if before.get(n) != after[n]]
    measured = [m["measured_ms"] for m in served["measured"].values() if m["measured_ms"]]
    lines = [f"served plan: predicted {served['plan']['predicted_ms']:.2f} ms"
             + (f", measured {sum(measured):.2f} ms of part time" if measured else ""),
             f"re-plan with measured costs: predicted {plan['predicted_ms']:.2f} ms, "
             f"{len(moved)} node(s) moved"]
    for name in moved[:10]:
        lines.append(f"  {name}: {before.get(name, '?')} -> {after[name]}")
    if len(moved) > 10:
        lines.append(f"  ... {len(moved) - 10} more")
    return "\n".join(lines)


def cmd_stats(client: Client, args: argparse.Namespace) -> int:
    stats = client.stats(args.interval)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    rows = []

    def shown(ms: float | None, bucketed: bool) -> str:
        if ms is None:
            return ">60000" if bucketed else "-"
        return f"<={ms:g}" if bucketed else f"{ms:.2f}"

    for key, m in sorted(stats["models"].items()):
        lat, bucketed = m["latency_ms"] or {}, False
        if not lat and m.get("fast_latency_ms"):  # only fast-path requests a worker ran
            lat, bucketed = m["fast_latency_ms"], True
        rows.append([key or "(unknown models)", f"{m['requests_per_s']:.1f}",
                     shown(lat["p50"], bucketed) if lat else "-",
                     shown(lat["p99"], bucketed) if lat else "-",
                     str(m["success"]), str(m["failure"]), f"{m['errors_per_s']:.1f}"])
    print(f"over the last {stats['interval_s']:.1f} s (p50/p99: the last requests of each "
          "model; <= for a model served only by fast-path workers: the bound of a metrics "
          "bucket, since the daemon started)")
    print(format_table(["MODEL", "REQ/s", "p50 ms", "p99 ms", "OK", "FAILED", "ERR/s"], rows)
          if rows else "no requests yet")
    generating = [[key, f"{m['tokens_per_s']:.1f}", str(m["tokens"]),
                   *(f"{(m[f] or {}).get(q, 0):.2f}" if m[f] else "-"
                     for f in ("first_token_ms", "inter_token_ms") for q in ("p50", "p99"))]
                  for key, m in sorted(stats["models"].items()) if "tokens" in m]
    if generating:  # (a generation is one request above, its whole time)
        print()
        print(format_table(["MODEL", "TOKENS/s", "TOKENS", "FIRST p50 ms", "FIRST p99 ms",
                            "BETWEEN p50 ms", "BETWEEN p99 ms"], generating))
    if stats["devices_busy"]:
        print()
        print(format_table(["DEVICE", "BUSY"], [[d, f"{100 * b:.0f}%"] for d, b in
                                                sorted(stats["devices_busy"].items())]))
    if stats.get("loads"):  # since the daemon started: a warm restart restores, only
        print("\nloads since start: " + ", ".join(f"{k} {v}" for k, v in
                                                 sorted(stats["loads"].items())))
    return 0


def cmd_compare(client: Client, args: argparse.Namespace) -> int:
    report = client.compare(args.name, args.version)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(compare_text(report))
    return 0


def compare_text(r: dict[str, Any]) -> str:
    """cuvilctl compare's tables: the whole model three ways, then every part's candidates."""
    def err(v: float | None) -> str:
        return "-" if v is None else f"{v:.1e}"

    budget = f", budget {r['max_error']:.2g}" if r.get("max_error") else ""
    source = "calibration" if r["calibrated"] else "random"
    lines = [f"{r['model']}: precision {r['policy']}{budget}; checked on {r['inputs']} "
             f"{source} input(s) against torch eager fp32 (max |y - y_eager| / max |y_eager|)"]
    rows = [["torch eager fp32 (in the daemon)", f"{r['eager_ms']:.2f}", "0", "-"]]
    for label, key in (("fp32 plan", "fp32"), ("chosen plan", "chosen")):
        c = r.get(key)
        if c:
            top1 = "-" if c["top1"] is None else f"{100 * c['top1']:.1f}%"
            rows.append([label, f"{c['p50_ms']:.2f}", err(c["error"]), top1])
    lines += ["", format_table(["RUN", "p50 ms", "ERROR", "TOP-1 AGREE"], rows), ""]
    cand = []
    for p in r["parts"]:
        for c in p["candidates"]:
            mark = "*" if (c["runtime"], c["precision"]) == (p["runtime"], p["precision"]) else ""
            cand.append([p["id"] + mark, p["device"], c["runtime"], c["precision"], c["status"],
                         f"{c['median_ms']:.2f}" if c["median_ms"] else "-",
                         err(c["rel_error"]) if c["status"] in ("ok", "inaccurate") else "-",
                         clip(c["reason"], 60)])
    lines.append(format_table(["PART", "DEVICE", "RUNTIME", "PRECISION", "STATUS", "p50 ms",
                               "ERROR", "WHY"], cand))
    lines.append("(* the candidate each part runs; ... ends a WHY cut short: --json has it "
                 "whole)")
    if r["notes"]:
        lines += ["", "why:"] + [f"  - {n}" for n in r["notes"]]
    return "\n".join(lines)


def clip(text: str, width: int) -> str:
    """`text` in at most `width` characters, ending in "..." where it was cut."""
    return text if len(text) <= width else text[:width - 3] + "..."


def cmd_infer(client: Client, args: argparse.Namespace) -> int:
    import numpy as np

    meta = client.metadata(args.name)
    names = [i["name"] for i in meta["inputs"]]
    if len(args.input) != len(names):
        print(f"cuvilctl: {args.name} takes {len(names)} inputs ({', '.join(names)}); give "
              f"one --input FILE.npy each, in that order", file=sys.stderr)
        return 1
    arrays = {}
    for name, path in zip(names, args.input, strict=True):
        try:
            arrays[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            print(f"cuvilctl: --input {path}: {e}", file=sys.stderr)
            return 1
    if args.fast:
        try:
            with Client(client.target, client.timeout, fast=True) as fast:
                outputs = fast.infer(args.name, arrays)
        except ValueError as e:  # not a unix socket
            print(f"cuvilctl: {e}", file=sys.stderr)
            return 1
    else:
        outputs = client.infer(args.name, arrays, shm=args.shm)
    if args.output:
        for name, tensor in outputs.items():
            np.save(Path(args.output) / f"{name}.npy", tensor.numpy())
    if args.json:
        print(json.dumps({n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix(
            "torch."), "data": t.flatten().tolist()} for n, t in outputs.items()}))
    else:
        for name, t in outputs.items():
            flat = t.flatten()
            preview = ", ".join(f"{v:.4g}" for v in flat[:8].tolist())
            print(f"{name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}: [{preview}"
                  f"{', ...' if flat.numel() > 8 else ''}]")
    return 0


def cmd_reload(client: Client, args: argparse.Namespace) -> int:
    result = client.reload()
    if args.json:
        print(json.dumps(result))
    elif result["ok"]:
        print(f"reloaded {result['config_path']}")
        if result["on_restart"]:
            print(f"changed, taking effect on restart: {', '.join(result['on_restart'])}")
    else:
        print(f"cuvilctl: reload failed, the running config stays: {result['error']}",
              file=sys.stderr)
    return 0 if result["ok"] else 1


def cmd_clean_shm(client: Client, args: argparse.Namespace) -> int:
    """Shared memory a killed client left (a process that ends unlinks its own)."""
    from cuvild.core.arena import reclaim_stale

    gone = reclaim_stale("cuvil-client-", dry_run=args.dry_run)
    if args.json:
        print(json.dumps({"removed" if not args.dry_run else "would_remove": gone}))
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(gone)} segment(s) of clients that are gone"
              + "".join(f"\n  /dev/shm/{n}" for n in gone))
    return 0


def build_parser() -> argparse.ArgumentParser:  # noqa: PLR0915 - argparse: a statement per command and option
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
    load = sub.add_parser("load", help="upload a .pt2 archive (torch.export.save) to the daemon")
    load.add_argument("name", help="model name: A-Z a-z 0-9 _ . -")
    load.add_argument("file", help="the .pt2 archive")
    load.add_argument("--version", default=None, help="version label (default: 1)")
    load.add_argument("--replace", action="store_true",
                      help="replace a registered name+version that has different content")
    load.add_argument("--precision", choices=("fp32", "auto"), default=None,
                      help="fp32: exact; auto: the fastest plan within --max-error of torch "
                           "eager (default: the daemon's engine.precision)")
    load.add_argument("--max-error", type=float, default=None, metavar="E",
                      help="auto's budget: max |y - y_eager| / max |y_eager| (default: the "
                           "daemon's engine.max_error)")
    load.add_argument("--calibration", metavar="FILE.npz", default=None,
                      help="calibration inputs, one array per model input, samples along "
                           "axis 0; int8 is tried only with them")
    load.add_argument("--max-batch", type=int, default=None, metavar="N",
                      help="merge concurrent requests into runs of up to N rows (needs a "
                           "dynamic first dimension; 1: off; default: the daemon's "
                           "engine.batching.max_batch)")
    load.add_argument("--max-delay-us", type=int, default=None, metavar="US",
                      help="how long the oldest queued request waits for others (default: "
                           "the daemon's engine.batching.max_delay_us)")
    load.add_argument("--no-wait", action="store_true",
                      help="return once uploaded, while the model still loads (default: wait "
                           "until it is ready; a failed build exits 1 with the reason)")
    load.add_argument("--wait-timeout", type=float, default=600.0, metavar="S",
                      help="seconds for the upload and the build together (default 600)")
    load.add_argument("--json", action="store_true", help="machine-readable output: the "
                      "result on stdout; while waiting, each phase a JSON line on stderr")
    load.set_defaults(func=cmd_load)
    models = sub.add_parser("models", help="list registered models")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.set_defaults(func=cmd_models)
    unload = sub.add_parser("unload", help="remove a model (every version unless --version)")
    unload.add_argument("name")
    unload.add_argument("--version", default=None)
    unload.add_argument("--json", action="store_true", help="machine-readable output")
    unload.set_defaults(func=cmd_unload)
    part = sub.add_parser("partition", help="show how a model is split across devices")
    part.add_argument("model", help="a .pt2 file, or the name of a model cuvild serves")
    part.add_argument("--profile", help="device profiles YAML: plan offline for that machine")
    part.add_argument("--objective", choices=("latency", "throughput"), default="latency")
    part.add_argument("--prompt-tokens", type=positive, metavar="N",
                      help="a model that keeps state (a language model) is priced for a "
                           f"generation: a prompt of this many tokens (default {PROMPT}) ...")
    part.add_argument("--generated-tokens", type=positive, metavar="N",
                      help=f"... then this many tokens generated (default {GENERATED})")
    part.add_argument("--replan", action="store_true",
                      help="for a served model: plan again now, with what its measured parts "
                           "taught the cost model, and show what moved")
    part.add_argument("--json", action="store_true", help="machine-readable output")
    part.add_argument("--dot", metavar="OUT.dot", help="write the plan as Graphviz DOT")
    part.add_argument("--svg", metavar="OUT.svg",
                      help="draw the plan as a timeline: a lane per device, a bar per part "
                           "(predicted, and measured once it served), cuts as arrows")
    part.set_defaults(func=cmd_partition)
    stats = sub.add_parser("stats", help="request rate, p50/p99 and errors per model; how "
                                         "busy each device is")
    stats.add_argument("--interval", type=float, default=1.0, metavar="S",
                       help="seconds between the two readings rates come from (default 1)")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(func=cmd_stats)
    compare = sub.add_parser("compare", help="latency and accuracy: torch eager vs the fp32 "
                                             "plan vs the plan the precision policy chose")
    compare.add_argument("name")
    compare.add_argument("--version", default=None)
    compare.add_argument("--json", action="store_true", help="machine-readable output")
    compare.set_defaults(func=cmd_compare)
    reload = sub.add_parser("reload", help="read the config file and the model repository "
                                           "again (as SIGHUP and systemctl reload do)")
    reload.add_argument("--json", action="store_true", help="machine-readable output")
    reload.set_defaults(func=cmd_reload)
    clean = sub.add_parser("clean-shm", help="remove the shared memory of client processes "
                                            "that were killed (/dev/shm/cuvil-client-PID-*)")
    clean.add_argument("--dry-run", action="store_true", help="only list them")
    clean.add_argument("--json", action="store_true", help="machine-readable output")
    clean.set_defaults(func=cmd_clean_shm)
    infer = sub.add_parser("infer", help="run a served model on .npy inputs")
    infer.add_argument("name")
    infer.add_argument("--input", action="append", default=[], metavar="FILE.npy",
                       help="one per model input, in order")
    infer.add_argument("--shm", action="store_true", help="pass tensors via shared memory")
    infer.add_argument("--fast", action="store_true", help="use the same-host fast path "
                       "(a session on the unix socket, no gRPC per request; docs/FASTPATH.md)")
    infer.add_argument("--output", metavar="DIR", help="also save outputs as DIR/NAME.npy")
    infer.add_argument("--json", action="store_true", help="machine-readable output")
    infer.set_defaults(func=cmd_infer)
    add_generate(sub)
    add_export_lm(sub)
    add_export_encoder(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[Client, argparse.Namespace], int] = args.func
    client = Client(args.target, timeout=args.timeout)
    try:
        return func(client, args)
    except CuvildError as err:  # the daemon's words; where none answered, where it looked
        print(f"cuvilctl: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `cuvilctl partition m | head`: the reader has what it wanted
        # (stdout pointed at /dev/null: the interpreter's own flush at exit would raise again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # (as a shell reports a process ended by SIGPIPE: 128 + 13)
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
