"""The speculation section of `producer status`: the run's acceptance overall and by category
(from the tallies counted as shards ship, common/keepers/spectally.py), each engine's (from
what its consumer wrote, its snapshot's `spec`), and the drafter's weakest category. Pure: the
figures come in read, the view and its lines go out."""

from __future__ import annotations

from genqueue.common.acceptance import (
    AcceptanceTable,
    Facet,
    Tally,
    category_order,
    figures,
    weakest_line,
)
from genqueue.common.snapshot import SpecTotals
from genqueue.producer.status.report import SpecCategory, SpecEngine, SpeculationView, SpecWeakest

#: Categories of one facet on the screen (`--wide`: all), the most answers first.
SHOWN_CATEGORIES = 8
#: Each acceptance figure on the screen says whose it is: the run's answers shipped by every
#: consumer (the tallies), or each consumer's written on this run (its snapshot). The engine's
#: own figure, over all it served, is the doctor's (under each consumer, `engine: ...`).
RUN_SCOPE = "acceptance (run, all consumers)"
CONSUMER_SCOPE = "acceptance (each consumer, this run)"
#: Columns of a category's name on the screen (`--wide`: its whole name); a longer one keeps its tail.
NAME_WIDTH = 40


def _figures(label: str, t: Tally) -> SpecCategory:
    return {"category": label, **figures(t)}


def engine_totals(raw: object) -> SpecTotals | None:
    """A consumer's figures for a run as its snapshot holds them (`runs[run].spec`), None when
    it holds none or something else (a hand edit, garbage): nothing to show for it."""
    if not isinstance(raw, dict):
        return None
    got = [raw.get(k) for k in ("answers", "steps", "drafted", "accepted")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in got):
        return None
    answers, steps, drafted, accepted = (int(v) for v in got)  # type: ignore[arg-type]  # checked above
    return {"answers": answers, "steps": steps, "drafted": drafted, "accepted": accepted}


def speculation_view(table: AcceptanceTable, engines: list[tuple[str, bool, SpecTotals]]) -> SpeculationView | None:
    """The section from the run's TABLE and its ENGINES (worker, live, what it wrote); None when
    neither holds a figure (a run without speculation shows nothing)."""
    if not table.overall.answers and not engines:
        return None
    by = {facet.value: [_figures(label, table.by[facet][label]) for label in category_order(facet, table.by[facet], table)]
          for facet in Facet}
    weakest: SpecWeakest | None = None
    found, line, base = table.weakest(), weakest_line(table), table.overall.rate
    if found is not None and line is not None and base is not None:
        facet, label, t = found
        weakest = {"facet": facet.value, "category": label, "answers": t.answers, "rate": round(t.rate or 0.0, 4),
                   "overall_rate": round(base, 4), "line": line}
    rows: list[SpecEngine] = []
    for worker, live, s in engines:
        t = Tally(s["answers"], s["steps"], s["drafted"], s["accepted"])
        rows.append({"worker": worker, "live": live, **figures(t)})
    return {**figures(table.overall), "by": by, "weakest": weakest, "engines": rows}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _len(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def speculation_lines(v: SpeculationView, width: int | None = None) -> list[str]:
    """The section's lines for a screen of WIDTH columns (None: `--wide`, every category, whole
    names); the caller wraps those longer than WIDTH."""
    wide = width is None
    if v["answers"]:
        head = (f"speculation  {RUN_SCOPE} {_pct(v['rate'])}, mean length {_len(v['mean_length'])}, "
                f"{v['answers']:,} answers shipped")
    else:
        head = f"speculation  {RUN_SCOPE}: no answer with figures shipped yet"
    out = [head]
    if v["weakest"] is not None:
        out.append(f"  {v['weakest']['line']}")
    if v["engines"]:
        out.append(f"  {CONSUMER_SCOPE}  " + ", ".join(
            f"{e['worker']} {_pct(e['rate'])} len {_len(e['mean_length'])} ({e['answers']:,} answers"
            f"{'' if e['live'] else ', gone'})" for e in v["engines"]))
    if not v["answers"]:
        return out
    shown = {facet: rows if wide else rows[:SHOWN_CATEGORIES] for facet, rows in v["by"].items()}
    col = max([len(row["category"]) for rows in shown.values() for row in rows] + [len("category")])
    col = col if wide else min(col, NAME_WIDTH)
    out.append(f"  {'by':<8} {'category':<{col}} {'answers':>9} {'rate':>6} {'mean len':>9}")
    for facet, rows in shown.items():
        for i, row in enumerate(rows):
            name = row["category"]
            if len(name) > col:  # a source's tail (its file name) says most
                name = "…" + name[len(name) - col + 1:]
            out.append(f"  {facet if i == 0 else '':<8} {name:<{col}} {row['answers']:>9,} {_pct(row['rate']):>6} "
                       f"{_len(row['mean_length']):>9}")
        if len(v["by"][facet]) > len(rows):
            out.append(f"  {'':<8} (+{len(v['by'][facet]) - len(rows)} more {facet} categories; --wide shows all)")
    return out
