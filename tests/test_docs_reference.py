"""The reference pages in docs/ say what the code has, so they cannot drift from it.

- docs/records.md: the record fields, against the record types of common/records.py, and its
  outcome and error-class tables against the enums;
- docs/metrics.md: every metric the consumer registers with prometheus_client, with its type
  and labels, and no other;
- docs/environment.md: every GENQUEUE_* variable the code, the scripts and the tests read, and
  none they do not;
- docs/enqueue.md: every rejection reason.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import get_type_hints

import prometheus_client
import pytest
from prometheus_client.metrics import MetricWrapperBase

import genqueue.consumer.worker  # noqa: F401 - the composition root: every metric is registered once it is imported
from genqueue.common.contracts import ErrorClass, Outcome, RejectReason
from genqueue.common.engineview import EngineBound
from genqueue.common.records import ErrorRecord, ResultRecord

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def section(text: str, heading: str) -> str:
    start = text.index(heading + "\n") + len(heading)
    level = heading.split(" ", 1)[0]
    end = re.search(rf"^{level} ", text[start:], re.MULTILINE)
    return text[start:start + end.start()] if end else text[start:]


def first_column(text: str) -> list[str]:
    """The first cell of every body row of the Markdown tables in TEXT."""
    rows = [line.strip() for line in text.splitlines() if line.strip().startswith("| `")]
    return [row.split("|")[1] for row in rows]


def names_in(cells: list[str], pattern: str = r"[a-z_]+") -> set[str]:
    return {name for cell in cells for name in re.findall(rf"`({pattern})`", cell)}


# -- records -------------------------------------------------------------------------------------

RECORDS = (DOCS / "records.md").read_text()


def test_every_record_field_is_documented_and_nothing_else() -> None:
    typed = set(get_type_hints(ResultRecord)) | set(get_type_hints(ErrorRecord))
    documented = names_in(first_column(section(RECORDS, "## Fields")))
    assert typed - documented == set(), f"fields missing from docs/records.md: {sorted(typed - documented)}"
    assert documented - typed == set(), f"docs/records.md fields no record type has: {sorted(documented - typed)}"


@pytest.mark.parametrize(("heading", "enum"), [("## Outcomes", Outcome), ("## Error classes", ErrorClass)])
def test_every_outcome_and_error_class_is_documented(heading: str, enum: type[StrEnum]) -> None:
    documented = names_in(first_column(section(RECORDS, heading)))
    assert documented == {e.value for e in enum}, f"docs/records.md {heading} against {enum.__name__}"


# -- metrics -------------------------------------------------------------------------------------

METRICS = (DOCS / "metrics.md").read_text()


def registered() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name as scraped (counters with _total) -> (type, label names), of every genqueue metric
    in prometheus_client's default registry. prometheus_client has no public way to list a
    metric's label names before it has children, hence _labelnames."""
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    from genqueue.consumer.metrics import ReadingGauge  # a gauge with no sample until a reading

    for collector in list(prometheus_client.REGISTRY._collector_to_names):
        if not isinstance(collector, MetricWrapperBase | ReadingGauge):
            continue
        (family,) = collector.describe()
        if not family.name.startswith("genqueue_"):
            continue
        name = f"{family.name}_total" if family.type == "counter" else family.name
        found[name] = (family.type, tuple(getattr(collector, "_labelnames", ())))
    return found


def documented_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in section(METRICS, "## The metrics").splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.split("|")[1:-1]]
        kind, _, labels = cells[1].partition(";")
        kind = kind.strip().removesuffix("s")
        label_names = tuple(x.strip() for x in re.sub(r"\([^)]*\)", "", labels).split(",") if x.strip())
        for name in re.findall(r"`(genqueue_[a-z_]+)`", cells[0]):
            found[name] = (kind, label_names)
    return found


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    have = registered()
    assert len(have) >= 15, f"found {len(have)} genqueue metrics: the registry scan is broken"
    documented = documented_metrics()
    assert sorted(set(have) - set(documented)) == [], "metrics docs/metrics.md does not list"
    assert sorted(set(documented) - set(have)) == [], "metrics docs/metrics.md lists that no consumer registers"
    wrong = {n: (documented[n], have[n]) for n in have if documented[n] != have[n]}
    assert not wrong, f"type or labels differ (docs, code): {wrong}"


def test_the_engine_doctors_verdicts_are_the_ones_documented() -> None:
    row = next(line for line in METRICS.splitlines() if line.startswith("| `genqueue_engine_bound`"))
    assert all(re.search(rf"\b{v.value}\b", row) for v in EngineBound), row


def test_every_pause_reason_and_job_ending_is_documented() -> None:
    from genqueue.consumer import telemetry

    reasons = METRICS[METRICS.index("`genqueue_paused{reason}`"):]
    reasons = reasons[:reasons.index("\n\n")]
    assert set(re.findall(r"`([a-z_]+)`", reasons)) - {"reason"} >= set(telemetry.PAUSE_REASONS), reasons
    # the endings are the keys of the snapshot's "jobs" (what the gauge is set from)
    source = Path(telemetry.__file__).read_text()
    jobs = re.search(r'"jobs": \{(.*?)\}', source, re.DOTALL)
    assert jobs, "no \"jobs\" in the consumer's snapshot: the scan is broken"
    endings = set(re.findall(r'"([a-z_]+)":', jobs[1]))
    assert len(endings) >= 5, endings
    table = METRICS[METRICS.index("| ending | the jobs |"):]
    assert names_in(first_column(table[:table.index("\n\n")])) == endings


def test_the_metrics_check_can_fail() -> None:
    table = documented_metrics()
    assert table["genqueue_completions_total"] == ("counter", ("run", "outcome"))
    assert table["genqueue_in_flight"] == ("gauge", ())


# -- environment ---------------------------------------------------------------------------------

ENVIRONMENT = (DOCS / "environment.md").read_text()
#: how code reads a variable: os.environ[...] / .get(...), getenv(...), click's envvar=, shell ${VAR
READS = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\(|envvar=)\s*["'](GENQUEUE_[A-Z0-9_]+)|\$\{?(GENQUEUE_[A-Z0-9_]+)""")
#: a name held in a constant and read through it (TEST_CLOCK_BEHIND = "GENQUEUE_...")
CONSTANT = re.compile(r"""^([A-Z_]+) = ["'](GENQUEUE_[A-Z0-9_]+)["']""", re.MULTILINE)


def sources() -> list[Path]:
    files = [p for d in ("common", "producer", "consumer", "tests", "bench") for p in (ROOT / d).rglob("*.py")]
    return files + [p for p in (ROOT / "scripts").iterdir() if p.is_file()] + [ROOT / "docker-compose.yml"]


def read_variables() -> set[str]:
    found: set[str] = set()
    for path in sources():
        text = path.read_text()
        found |= {a or b for a, b in READS.findall(text)}
        for const, name in CONSTANT.findall(text):
            if re.search(rf"environ(?:\.get)?\(?\[?\s*{const}\b|getenv\(\s*{const}\b", text):
                found.add(name)
    return found


def test_every_variable_the_code_reads_is_documented() -> None:
    read = read_variables()
    assert {"GENQUEUE_OUTPUT", "GENQUEUE_VENV", "GENQUEUE_TEST_CLOCK_BEHIND"} <= read, "the scan is broken"
    documented = set(re.findall(r"`(GENQUEUE_[A-Z0-9_]+)`", ENVIRONMENT))
    assert sorted(read - documented) == [], "variables the code reads that docs/environment.md does not list"


def test_every_documented_variable_is_read_somewhere() -> None:
    text = "\n".join(p.read_text() for p in sources())
    documented = set(re.findall(r"`((?:GENQUEUE|RQ_DASHBOARD|AWS)_[A-Z0-9_]+|REDIS_URL|DEMO_OUT)`", ENVIRONMENT))
    assert documented, "found no variable in docs/environment.md"
    documented -= {"RQ_DASHBOARD_USERNAME"}  # an example of rq-dashboard's own prefix
    assert sorted(v for v in documented if v not in text) == [], "docs/environment.md lists variables nothing reads"


# -- rejection reasons ---------------------------------------------------------------------------


def test_every_rejection_reason_is_documented() -> None:
    text = (DOCS / "enqueue.md").read_text()
    table = text[text.index("| reason | the record |"):]
    table = table[:table.index("\n\n")]
    assert names_in(first_column(table)) == {r.value for r in RejectReason}
