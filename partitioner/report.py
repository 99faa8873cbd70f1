"""Human views of a Plan: text tables (`explain`) and a Graphviz picture (`to_dot`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partitioner.plan import Plan


def explain(plan: Plan) -> str:
    """Parts, cuts, totals and notes as aligned text tables."""
    lines = [f"plan: {len(plan.parts)} part(s), objective {plan.objective}, method {plan.method}"
             + (" (proven optimal)" if plan.proven_optimal else "")]
    rows = [("part", "device", "runtime", "precision", "error", "nodes", "GFLOPs", "ms", "start",
             "end")]
    for p in plan.parts:
        error = "-" if p.error is None else f"{p.error:.1e}"  # measured, once built
        rows.append((p.id, p.device, p.runtime, p.precision, error, str(len(p.nodes)),
                     f"{p.gflops:.3f}", f"{p.predicted_ms:.4f}", f"{p.start_ms:.4f}",
                     f"{p.finish_ms:.4f}"))
    lines += _table(rows)
    if plan.cuts:
        lines.append("")
        rows = [("cut", "bytes", "ms", "tensors")]
        for c in plan.cuts:
            shown = ", ".join(c.tensors[:4]) + (" ..." if len(c.tensors) > 4 else "")
            rows.append((f"{c.src} -> {c.dst}", f"{c.bytes:,}", f"{c.predicted_ms:.4f}", shown))
        lines += _table(rows)
    lines.append("")
    moved = sum(c.bytes for c in plan.cuts)
    lines.append(f"predicted {plan.objective}: {plan.predicted_ms:.4f} ms "
                 f"(latency {plan.latency_ms:.4f} ms, pipeline period {plan.period_ms:.4f} ms); "
                 f"{sum(p.gflops for p in plan.parts):.3f} GFLOPs; {moved:,} bytes copied")
    peak = ", ".join(f"{d} {b / 1e6:.1f} MB" for d, b in plan.peak_bytes.items())
    lines.append(f"peak memory: {peak}")
    if plan.phases:
        lines.append("")
        lines += generation(plan.phases)
    if plan.notes:
        lines.append("")
        lines.append("why:")
        lines += [f"  - {note}" for note in plan.notes]
    return "\n".join(lines)


def generation(phases: dict[str, Any]) -> list[str]:
    """A stateful model's plan priced for a generation (partitioner/phases.py): the prefill,
    a decode step, tokens a second and the whole, for this plan, the peers' memory-only rule
    and each device alone."""
    from partitioner.phases import Generation

    gen = Generation(phases["prompt"], phases["generated"], phases["chunk"])
    rows = [("generation", "prefill ms", "decode ms a step", "tokens/s", "in all ms")]

    def row(name: str, p: dict[str, float] | None) -> tuple[str, ...]:
        if p is None:
            return (name, "-", "-", "-", "cannot hold or run it")
        rate = f"{1e3 / p['step_ms']:.1f}" if p["step_ms"] > 0 else "-"
        return (name, f"{p['prefill_ms']:.2f}", f"{p['step_ms']:.3f}", rate,
                f"{p['total_ms']:.1f}")

    rows.append(row("this plan", phases["plan"]))
    if "memory_rule" in phases:
        rule = phases["memory_rule"]
        rows.append(row(f"memory-only rule ({rule['device']} first)", rule))
    rows += [row(f"{dev} alone", p) for dev, p in phases["alone"].items()]
    return [f"priced for {gen.describe()} (parts above: a decode step):", *_table(rows)]


def to_dot(plan: Plan, nodes: bool = False) -> str:
    """DOT text: one box (or, with nodes=True, one cluster of nodes) per part, cut edges."""
    palette = {"cpu": "lightblue", "gpu": "palegreen", "npu": "khaki"}
    out = ["digraph plan {", "  rankdir=LR;", "  node [shape=box, style=filled];",
           '  host [shape=ellipse, fillcolor=white, label="host memory"];']
    for p in plan.parts:
        color = next((c for k, c in palette.items() if p.device.startswith(k)), "lightgray")
        label = f"{p.id}\\n{p.device} ({p.runtime}, {p.precision})\\n" \
                f"{len(p.nodes)} nodes, {p.predicted_ms:.3f} ms"
        if nodes:
            out.append(f'  subgraph "cluster_{p.id}" {{')
            out.append(f'    label="{label}"; style=filled; fillcolor={color};')
            out.append(f'    "{p.id}" [shape=point];')
            out += [f'    "{p.id}/{name}" [label="{name}", fillcolor=white];' for name in p.nodes]
            out.append("  }")
        else:
            out.append(f'  "{p.id}" [label="{label}", fillcolor={color}];')
    for c in plan.cuts:
        label = f"{size_text(c.bytes)}, {c.predicted_ms:.3f} ms"
        out.append(f'  "{c.src}" -> "{c.dst}" [label="{label}"];')
    out.append("}")
    return "\n".join(out)


def size_text(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return lines
