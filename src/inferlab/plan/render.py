"""Terminal tables for plans and comparisons (rich). JSON comes from the dataclasses' to_dict."""

from __future__ import annotations

from typing import Any

from inferlab.plan.compare import ComparisonRow
from inferlab.plan.figures import format_value
from inferlab.plan.planner import Plan


def _console(console: Any | None) -> Any:
    from rich.console import Console

    return console or Console()


def print_plan(plan: Plan, console: Any | None = None) -> None:
    from rich.table import Table

    c = _console(console)
    i = plan.inputs
    c.print(f"[bold]{i['model']}[/] on [bold]{i['hardware']}[/]: weights {i['weight_precision']}, "
            f"KV {i['kv_precision']}, {i['input_len']} prompt + {i['output_len']} output tokens")
    t = Table(title="inferlab plan", caption="kind: computed = arithmetic on configs and spec sheets; "
              "cited = published; measured = timed here", caption_justify="left")
    t.add_column("figure", style="bold")
    t.add_column("value", justify="right")
    t.add_column("kind")
    t.add_column("how", overflow="fold")
    sources: list[str] = []
    previous: list[str] = []
    for f in plan.figures:
        # The JSON keeps every figure's full assumptions; the table says "as above" for repeats.
        fresh = [a for a in f.assumptions if a not in previous]
        how = "; ".join((["as above"] if len(fresh) < len(f.assumptions) else []) + fresh)
        previous = f.assumptions
        if f.source:
            if f.source not in sources:
                sources.append(f.source)
            how = f"{how} [{sources.index(f.source) + 1}]" if how else f"[{sources.index(f.source) + 1}]"
        t.add_row(f.title, format_value(f.value, f.unit), f.kind, how)
    c.print(t)
    for n, s in enumerate(sources, 1):
        c.print(f"[{n}] {s}", highlight=False, markup=False)
    b = Table(title="decode against batch size (computed)")
    for col in ("batch", "step time", "per-user tok/s", "total tok/s", "bound", "fits"):
        b.add_column(col, justify="right")
    for r in plan.by_batch:
        b.add_row(str(r.batch), format_value(r.step_time.value, "s"), f"{r.per_user_tokens_per_s.value:,.1f}",
                  f"{r.total_tokens_per_s.value:,.0f}", r.bound, "yes" if r.fits else "no")
    c.print(b)


def print_comparison(rows: list[ComparisonRow], title: str, console: Any | None = None,
                     notes: list[str] | None = None) -> None:
    from rich.table import Table

    c = _console(console)
    t = Table(title=title, caption="ratio = predicted / reference", caption_justify="left")
    t.add_column("figure", style="bold")
    t.add_column("predicted", justify="right")
    t.add_column("reference", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("reference is")
    for r in rows:
        ratio = "—" if r.ratio is None else f"{r.ratio:.2f}"
        t.add_row(r.label, f"{format_value(r.predicted.value, r.unit)} ({r.predicted.kind})",
                  format_value(r.reference.value, r.unit), ratio, r.reference.kind)
    c.print(t)
    sources = sorted({r.reference.source for r in rows if r.reference.source})
    for s in sources:
        c.print(f"• reference: {s}")
    for n in notes or []:
        c.print(f"• {n}")
