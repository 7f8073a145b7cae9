"""deploy/grafana/dashboards/genqueue.json against a live consumer: every metric and label its
queries name is on the consumer's /metrics page, and (where Prometheus is installed) a real
Prometheus scraping that consumer answers every query with data, and runs docs/metrics.md's example
queries."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import cli, free_port, http_text, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "genqueue.json"
METRICS_PAGE = ROOT / "docs" / "metrics.md"
#: Labels Prometheus adds to every scraped series, and histogram buckets' own.
TARGET_LABELS = {"instance", "job", "le"}
METRIC = re.compile(r"\b(genqueue_[a-z_]+)\b")
SELECTOR = re.compile(r"\b(genqueue_[a-z_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_]+)\s*(?:=~|!~|!=|=)")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\((\w+),\s*(\w+)\)")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, and the variables' queries."""
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for var in dash["templating"]["list"]:
        yield f"variable {var['name']}", var["query"]["query"]


def concrete(expr: str) -> str:
    """EXPR as Grafana sends it with every instance and run selected, scraped each second."""
    return expr.replace("$__rate_interval", "10s").replace("$instance", ".*").replace("$run", ".*")


def exposed(text: str) -> dict[str, set[str]]:
    """sample name -> the label names it carries, from a /metrics page."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_the_dashboard_is_well_formed():
    dash = dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert dash["uid"] == "genqueue"
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("tokens/s", "completions/s", "in flight", "running and waiting", "kv cache", "error",
                  "latency", "spool", "shards shipped", "queued", "job endings", "retries", "paused"):
        assert topic in titles, f"no panel about {topic}"
    for panel in dash["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"instance", "run"}


@pytest.fixture(scope="module")
def live(tmp_path_factory, redis_server) -> Iterator[tuple[int, str]]:
    """A consumer generating a run against the stand-in (with a few 500s, so retries and error
    paths have series), its metrics port and the last /metrics page that showed every metric."""
    tmp = tmp_path_factory.mktemp("grafana")
    env = {"REDIS_URL": redis_server.url}
    data = write_jsonl(tmp / "graf.jsonl", [sharegpt(i) for i in range(400)])
    cli("producer", "enqueue", str(data), "--batch-size", "8", "--max-tokens", "200", "--output", str(tmp / "out"),
        "--rejects", str(tmp / "r"), env=env)
    # --kv-cache-tokens: a KV model, so the engine reports its cache (without one it has no KV series);
    # speculating with per-request figures, so the acceptance counters have series
    sim = Sim(tmp, "--step-time", "0.01", "--mean-tokens", "40", "--error-rate", "0.05", "--slots", "16",
              "--kv-cache-tokens", "1000000", "--spec-tokens", "3", "--spec-acceptance", "0.7",
              "--per-request-spec-decode-metrics", "summary")
    port = free_port()
    consumer = Proc("consumer", ["run", "--run", "graf", "--endpoint", sim.url, "-c", "16", "--metrics-port", str(port),
                                 "--shard-max-age", "1", "--spool", str(tmp / "spool")], tmp / "consumer.log", env=env)
    wanted = {m for _, e in queries(dashboard()) for m in METRIC.findall(e)}
    page = ""
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert consumer.p.poll() is None, consumer.output()
            got = http_text(f"http://127.0.0.1:{port}/metrics", timeout=5)
            if got is None:
                time.sleep(0.2)
                continue
            page = got
            if wanted <= set(exposed(page)) and 'genqueue_shards_shipped ' in page and \
                    not re.search(r"^genqueue_shards_shipped 0\.0$", page, re.MULTILINE):
                break
            time.sleep(0.5)
        yield port, page
    finally:
        consumer.kill()
        sim.stop()


def test_every_metric_and_label_the_dashboard_queries_is_on_a_live_consumer(live):
    _, page = live
    have = exposed(page)
    missing = sorted({m for _, e in queries(dashboard()) for m in METRIC.findall(e)} - set(have))
    assert not missing, f"the dashboard queries metrics the consumer does not export: {missing}"
    for title, expr in queries(dashboard()):
        metrics = METRIC.findall(expr)
        for name, matchers in SELECTOR.findall(expr):
            for label in MATCHER.findall(matchers):
                assert label in have[name] | TARGET_LABELS, f"{title}: {name} has no label {label}"
        for group in BY.findall(expr):
            for label in (x.strip() for x in group.split(",") if x.strip()):
                assert any(label in have[m] for m in metrics) or label in TARGET_LABELS, f"{title}: by {label}"
        for name, label in LABEL_VALUES.findall(expr):
            assert label in have[name] | TARGET_LABELS, f"{title}: {name} has no label {label}"


def test_the_per_run_gauges_are_the_runs_share(live):
    """A consumer serving one run: each run gauge is the consumer-wide figure (published from the
    same snapshot), under the run's label."""
    port, page = live
    pairs = {"genqueue_run_in_flight": "genqueue_in_flight", "genqueue_run_pending_items": "genqueue_pending_items",
             "genqueue_run_shards_shipped": "genqueue_shards_shipped"}
    for _ in range(5):  # a scrape may fall between two gauges' updates of one publish: then the next one
        values = {(s.name, s.labels.get("run")): s.value for f in text_string_to_metric_families(page)
                  for s in f.samples}
        if all(values[(per_run, "graf")] == values[(whole, None)] for per_run, whole in pairs.items()):
            break
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            page = r.read().decode()
    for per_run, whole in pairs.items():
        assert values[(per_run, "graf")] == values[(whole, None)], (per_run, values[(per_run, "graf")])
    assert values[("genqueue_run_shards_shipped", "graf")] > 0 and values[("genqueue_run_shipped_bytes", "graf")] > 0
    for name in ("genqueue_run_held_jobs", "genqueue_run_unshipped_records", "genqueue_run_shards_waiting"):
        assert values[(name, "graf")] >= 0


def prometheus_query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


@pytest.fixture(scope="module")
def prometheus(live, tmp_path_factory) -> Iterator[str]:
    """A real Prometheus scraping the live consumer every second; its base URL once it has 8 scrapes."""
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install --no-install-recommends prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    metrics_port, _ = live
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: genqueue\n    static_configs:\n"
                      f"      - targets: ['127.0.0.1:{metrics_port}']\n        labels: {{instance: gpu0}}\n")
    prom = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "prometheus.log", "wb"))  # noqa: SIM115 - the process holds it
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert prom.poll() is None, (tmp / "prometheus.log").read_text()
            try:
                got = prometheus_query(base, "count_over_time(genqueue_in_flight[1m])")
                if got["data"]["result"] and float(got["data"]["result"][0]["value"][1]) >= 8:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("Prometheus never scraped the consumer 8 times")
        yield base
    finally:
        prom.terminate()
        prom.wait(10)


@pytest.mark.slow
def test_a_real_prometheus_answers_every_panel_with_data(prometheus):
    empty = []
    for title, expr in queries(dashboard()):
        m = LABEL_VALUES.fullmatch(expr)
        q = m.group(1) if m else concrete(expr)
        got = prometheus_query(prometheus, q)
        assert got["status"] == "success", f"{title}: {q}: {got.get('error')}"
        if not got["data"]["result"]:
            empty.append(f"{title}: {q}")
        elif m:
            assert all(m.group(2) in r["metric"] for r in got["data"]["result"]), title
    assert not empty, "queries with no data:\n" + "\n".join(empty)


def readme_examples() -> list[str]:
    """docs/metrics.md's example PromQL, one query a line (comments dropped)."""
    text = METRICS_PAGE.read_text()
    block = text[text.index("```promql") + len("```promql"):]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block[:block.index("```")].splitlines()]
    return [line for line in lines if line]


def test_the_readme_example_queries_run_on_a_real_prometheus(live, prometheus):
    examples = readme_examples()
    assert len(examples) >= 5
    have = exposed(live[1])
    for q in examples:
        missing = set(METRIC.findall(q)) - set(have)
        assert not missing, f"{q}: no such metric {missing}"
        got = prometheus_query(prometheus, q)
        assert got["status"] == "success", f"{q}: {got.get('error')}"
