"""The plan as a picture: an SVG timeline a browser opens (`cuvilctl partition NAME --svg`).

One lane per device; one bar per part from its predicted start to its predicted finish,
labelled with its runtime, precision and time; when the model has served requests, a
thinner bar under it as long as the part measured; an arrow for each cut between parts,
labelled with the bytes it moves. Written by hand (a few dozen elements; no library to pin).
"""

from __future__ import annotations

import math
from html import escape
from typing import TYPE_CHECKING, Any

from partitioner.report import size_text

if TYPE_CHECKING:
    from partitioner.plan import Plan

WIDTH = 960
LEFT = 90  # the lanes' names
LANE = 70
TOP = 60
COLORS = {"cpu": "#8ecae6", "gpu": "#95d5b2", "npu": "#f6d186"}
MEASURED = "#6c757d"


def to_svg(plan: Plan, measured: dict[str, Any] | None = None) -> str:
    """SVG of `plan` on a time axis in ms; `measured` maps part id -> {"measured_ms": ...}
    (GetPlan's measured map) to draw what parts really took beside what was predicted."""
    measured = measured or {}
    devices = list(dict.fromkeys(p.device for p in plan.parts))
    lane = {d: i for i, d in enumerate(devices)}
    ends = [p.finish_ms for p in plan.parts] + [
        p.start_ms + (measured.get(p.id, {}).get("measured_ms") or 0) for p in plan.parts]
    span = max([*ends, 1e-6]) * 1.08
    scale = (WIDTH - LEFT - 30) / span

    def x(ms: float) -> float:
        return LEFT + ms * scale

    height = TOP + LANE * len(devices) + 70
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
           'fill="#333"/></marker></defs>',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="15" font-weight="bold">'
           f'{escape(_title(plan))}</text>',
           f'<text x="{LEFT}" y="40" fill="#555">bars: predicted start to finish; grey under '
           'them: measured; arrows: cuts (bytes through the arena)</text>']
    for d, i in lane.items():
        y = TOP + i * LANE
        out.append(f'<rect class="lane" x="0" y="{y}" width="{WIDTH}" height="{LANE - 6}" '
                   f'fill="{"#f8f9fa" if i % 2 == 0 else "#ffffff"}"/>')
        out.append(f'<text x="8" y="{y + LANE / 2}" font-weight="bold">{escape(d)}</text>')
    for p in plan.parts:
        y = TOP + lane[p.device] * LANE + 8
        w = max((p.finish_ms - p.start_ms) * scale, 2.0)
        color = next((c for k, c in COLORS.items() if p.device.startswith(k)), "#ced4da")
        label = f"{p.id} {p.runtime} {p.precision} {p.predicted_ms:.2f} ms"
        out.append(f'<g class="part" data-part="{escape(p.id)}"><rect x="{x(p.start_ms):.1f}" '
                   f'y="{y}" width="{w:.1f}" height="30" rx="3" fill="{color}" stroke="#333">'
                   f'<title>{escape(label)}, {len(p.nodes)} nodes</title></rect>'
                   f'<text x="{x(p.start_ms) + 4:.1f}" y="{y + 19}">{escape(label)}</text></g>')
        ms = measured.get(p.id, {}).get("measured_ms")
        if ms:
            mw = max(ms * scale, 2.0)
            out.append(f'<g class="measured" data-part="{escape(p.id)}"><rect '
                       f'x="{x(p.start_ms):.1f}" y="{y + 34}" width="{mw:.1f}" height="8" '
                       f'fill="{MEASURED}"><title>{escape(p.id)} measured {ms:.2f} ms</title>'
                       f'</rect><text x="{x(p.start_ms) + mw + 4:.1f}" y="{y + 42}" '
                       f'font-size="10" fill="{MEASURED}">measured {ms:.2f} ms</text></g>')
    parts = {p.id: p for p in plan.parts}
    for c in plan.cuts:
        if c.src not in parts or c.dst not in parts:
            continue  # from or to host memory: in the notes below, not as arrows
        a, b = parts[c.src], parts[c.dst]
        y1 = TOP + lane[a.device] * LANE + 23
        y2 = TOP + lane[b.device] * LANE + 23
        x1, x2 = x(a.finish_ms), max(x(b.start_ms), x(a.finish_ms) + 12)
        out.append(f'<g class="cut"><line x1="{x1:.1f}" y1="{y1}" x2="{x2:.1f}" y2="{y2}" '
                   f'stroke="#333" stroke-width="1.5" marker-end="url(#arrow)"/>'
                   f'<text x="{(x1 + x2) / 2 + 4:.1f}" y="{(y1 + y2) / 2 - 4:.1f}" '
                   f'font-size="10">{escape(size_text(c.bytes))}</text></g>')
    axis_y = TOP + LANE * len(devices) + 10
    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{WIDTH - 20}" y2="{axis_y}" '
               'stroke="#333"/>')
    for tick in _ticks(span):
        out.append(f'<line x1="{x(tick):.1f}" y1="{axis_y}" x2="{x(tick):.1f}" '
                   f'y2="{axis_y + 5}" stroke="#333"/><text x="{x(tick):.1f}" '
                   f'y="{axis_y + 18}" text-anchor="middle" font-size="10">{tick:g} ms</text>')
    io = [c for c in plan.cuts if c.src not in parts or c.dst not in parts]
    if io:
        text = "; ".join(f"{c.src} -> {c.dst} {size_text(c.bytes)}" for c in io)
        out.append(f'<text x="{LEFT}" y="{axis_y + 40}" fill="#555" font-size="11">'
                   f'host memory: {escape(text)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _title(plan: Plan) -> str:
    return (f"plan: {len(plan.parts)} part(s) on {len({p.device for p in plan.parts})} "
            f"device(s), predicted {plan.objective} {plan.predicted_ms:.2f} ms")


def _ticks(span: float) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart), at most 8, within `span`."""
    step = 10 ** math.floor(math.log10(span / 8))
    step *= next(m for m in (1, 2, 5, 10) if span / (step * m) <= 8)
    return [round(i * step, 9) for i in range(int(span / step) + 1)]

