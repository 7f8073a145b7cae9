"""rq-dashboard's web app made to read genqueue (see the wing's docstring, consumer/dashboard/):
its worker views read jobs with the JSON serializer and list every job a worker holds, its job
lists and job pages show whatever a genqueue queue holds, each genqueue job named by `job_label`
(its run, items, and pack or first key) rather than a call string of its whole payload, an ended
job whose hash rq expired shown as such (not failed, no Requeue), and its registry sweeps use
Redis's clock (rqcompat.sweep_in_redis_time). Everything here patches rq-dashboard, written and tested
against its 0.9 series; rq itself is touched only in consumer/rqcompat.py.
"""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from genqueue.common.keepers.rqaccess import job_items, job_reference, queue_name

log = logging.getLogger(__name__)

#: The rq-dashboard series whose internals `patch` was written and tested against.
TESTED_SERIES = "0.9."

#: genqueue's rq queues are named <this><run>.
QUEUE_PREFIX = queue_name("")

INSTALL_HINT = "pip install 'rq-dashboard==0.9.*' six (from a checkout: pip install -e '.[dashboard]')"


class DashboardMissing(Exception):
    """rq-dashboard, or a module it needs, is not installed."""


def load() -> tuple[ModuleType, ModuleType]:
    """rq-dashboard's cli and web modules; DashboardMissing naming what is absent."""
    try:
        cli = importlib.import_module("rq_dashboard.cli")
        web = importlib.import_module("rq_dashboard.web")
    except ModuleNotFoundError as e:
        raise DashboardMissing(f"rq-dashboard cannot start here ({e}): {INSTALL_HINT}") from None
    return cli, web


def patch(web: ModuleType) -> None:
    """Make rq-dashboard's views read genqueue's JSON jobs (see the wing's docstring)."""
    from rq.exceptions import DeserializationError
    from rq.serializers import JSONSerializer

    from genqueue.consumer.rqcompat import sweep_in_redis_time

    worker_cls: Any = web.Worker

    class JsonWorker(worker_cls):  # type: ignore[misc]  # rq-dashboard's Worker, untyped to mypy here
        @classmethod
        def all(cls, *args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("serializer", JSONSerializer)
            return super().all(*args, **kwargs)

        def get_current_job(self) -> Any:
            try:
                return super().get_current_job()
            except Exception as e:  # noqa: BLE001 - a current job rq cannot load: shown by its id
                return _Unloadable(str(self.get_current_job_id()), f"{type(e).__name__}: {str(e)[:120]}")

    show_current = web.serialize_current_job

    def serialize_current_job(job: Any) -> Any:
        if isinstance(job, _Unloadable):
            return {"job_id": job.id, "description": job.description, "created_at": None,
                    "call_string": "(rq cannot load it)"}
        label = job_label(job) if job is not None else None
        try:
            shown = show_current(job)
        except DeserializationError:  # a job of some other worker, not JSON: show what is readable
            return {"job_id": job.id, "description": job.description, "created_at": None,
                    "call_string": "(payload is not JSON)"}
        if label is not None and isinstance(shown, dict):  # not its payload as a call string
            shown.update(description=label, call_string=label)
        return shown

    # setattr: mypy sees rq-dashboard's modules as plain ModuleType
    setattr(web, "Worker", JsonWorker)  # noqa: B010
    setattr(web, "serialize_current_job", serialize_current_job)  # noqa: B010
    patch_held_jobs(web)
    patch_job_lists(web)
    sweep_in_redis_time()  # its registry sweeps: consumer/rqcompat.py


def patch_held_jobs(web: ModuleType) -> None:
    """workers.json gives each worker `current_jobs`, every job it holds (its rq executions),
    beside rq-dashboard's `current_job` (one of them), and the Workers page lists them all: a
    consumer holds many jobs at once. rq-dashboard's own view builds the rest of each row."""
    from flask import current_app
    from jinja2 import ChoiceLoader, DictLoader

    from genqueue.common.keepers.rqaccess import SERIALIZER

    own_view = web.list_workers.__wrapped__  # under rq-dashboard's @jsonify (functools.wraps)

    def held(conn: Any, name: str) -> list[Any]:
        worker = web.Worker.find_by_key(web.Worker.redis_worker_namespace_prefix + name, connection=conn)
        if worker is None:  # gone since rq-dashboard listed it
            return []
        jobs = []
        for job_id in sorted({e.job_id for e in worker.get_current_executions(refresh=True)}):
            try:
                job: Any = web.Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
            except Exception as e:  # noqa: BLE001 - a held job rq cannot load: shown by its id
                job = _Unloadable(job_id, f"{type(e).__name__}: {str(e)[:120]}")
            jobs.append(web.serialize_current_job(job))
        return jobs

    def list_workers(instance_number: int) -> dict[str, Any]:
        listed: dict[str, Any] = own_view(instance_number)
        conn = getattr(current_app, "redis_conn")  # noqa: B009 - set by rq-dashboard
        for row in listed["workers"]:
            row["current_jobs"] = held(conn, row["name"])
        return listed

    view = web.jsonify(list_workers)

    page = workers_page(Path(str(web.__file__)).parent / "templates" / WORKERS_TEMPLATE)
    if page is None:
        log.warning("rq-dashboard's Workers page is not the one genqueue knows: it shows one job per worker")

    def on_app(state: Any) -> None:  # once rq-dashboard's blueprint is on its app
        state.app.view_functions[f"{state.name_prefix}.{state.name}.list_workers".lstrip(".")] = view
        if page is not None:  # ahead of the app's loader: rq-dashboard's app finds its templates itself
            state.app.jinja_loader = ChoiceLoader([DictLoader({WORKERS_TEMPLATE: page}), state.app.jinja_loader])

    web.blueprint.record(on_app)


#: rq-dashboard's Workers page, and its cell showing one current job per worker.
WORKERS_TEMPLATE = "rq_dashboard/workers.html"
ONE_JOB_CELL = re.compile(r"<% if \(d\.current_job !== 'idle'\) \{ %>.*?<td><%= d\.current_job %></td>\s*<% \} %>",
                          re.DOTALL)
HELD_JOBS_CELL = """<td>
            <% if (d.current_jobs && d.current_jobs.length) { %><% _.each(d.current_jobs, function(job) { %>
                <div title="Job ID: <%- job.job_id %>&#013;&#010;Description: <%- job.description %>&#013;&#010;Created at: <%= toRelative(job.created_at) %>">
                    <a href="<%= url_for_single_job_view(job.job_id) %>"><%- job.call_string %></a>
                </div>
            <% }); %><% } else { %>idle<% } %>
            </td>"""


def workers_page(path: Path) -> str | None:
    """rq-dashboard's Workers page listing every job a worker holds; None when PATH is not the
    page this was written for (then rq-dashboard's own page is left as it is)."""
    try:
        source = path.read_text()
    except OSError:
        return None
    page, n = ONE_JOB_CELL.subn(HELD_JOBS_CELL, source)
    if n != 1 or "Current&nbsp;job<" not in page:
        return None
    return page.replace("Current&nbsp;job<", "Jobs&nbsp;held<")


def job_label(job: Any) -> str | None:
    """genqueue's name for the rq job JOB: `genqueue run=R items=N` and its pack and block (by
    reference) or its first item's key (inline); None for a job of another application's queue,
    or one whose payload does not read as genqueue's (then rq-dashboard's own text is shown)."""
    origin = str(getattr(job, "origin", "") or "")
    if not origin.startswith(QUEUE_PREFIX):
        return None
    head = f"genqueue run={origin.removeprefix(QUEUE_PREFIX)}"
    try:
        ref = job_reference(job.args, job.kwargs, job.meta)
        if ref is not None:
            return f"{head} items={job.meta.get('items', '?')} pack={ref.pack} block={ref.block}"
        items = job_items(job.args)
        return f"{head} items={len(items)} first_key={items[0]['key']}"
    except Exception:  # noqa: BLE001 - a payload that is not genqueue's: rq-dashboard's own text
        return None


class _Unloadable:
    """A worker's current job that rq cannot load: what the workers page shows of it."""

    def __init__(self, job_id: str, why: str) -> None:
        self.id = job_id
        self.description = f"(malformed: {why})"


def patch_job_lists(web: ModuleType) -> None:
    """rq-dashboard's job lists, job page and job JSON, whatever a genqueue queue holds (see the
    wing's docstring). Queues of other applications are shown by rq-dashboard's own code."""
    from flask import current_app, request
    from werkzeug.exceptions import HTTPException

    from genqueue.common.keepers.rqaccess import JobPlace, place_page
    from genqueue.common.keepers.rqjobs import JobKind, job_kind

    page_of = web.get_queue_registry_jobs_count
    serialize_job = web.serialize_job

    def row(conn: Any, member: bytes, place: JobPlace) -> dict[str, Any]:
        jid = member.decode(errors="replace")
        utf8 = jid.encode() == member  # else no job can have that id: no hash is looked for
        if place is JobPlace.STARTED and ":" in jid:  # "<job id>:<execution id>"
            jid = jid.rsplit(":", 1)[0]
        kind, why = job_kind(conn, jid, place) if utf8 else (JobKind.MALFORMED, "id is not UTF-8 text")
        blank = {"id": jid, "created_at": None, "started_at": None, "ended_at": None}
        if kind is JobKind.EXPIRED:  # rq's normal life: no exc_info, so no Requeue button
            return {**blank, "exc_info": None, "description": f"({why})"}
        if kind is JobKind.USABLE:
            try:
                job = web.Job.fetch(jid, connection=conn, serializer=web.config.serializer)
                shown = dict(serialize_job(job))
                shown["description"] = job_label(job) or shown["description"]
                return shown
            except Exception as e:  # noqa: BLE001 - whatever rq-dashboard cannot show is named, not a 500
                why = f"{type(e).__name__}: {str(e)[:120]}"
        return {**blank, "exc_info": why, "description": f"(malformed: {why})"}

    def jobs_page(queue_name: str, registry_name: str, offset: int, per_page: int, order: str,
                  connection: Any) -> tuple[int, list[dict[str, Any]]]:
        if not queue_name.startswith(QUEUE_PREFIX) or registry_name not in set(JobPlace):
            return page_of(queue_name, registry_name, offset, per_page, order, connection)  # type: ignore[no-any-return]
        place = JobPlace(registry_name)
        total, members = place_page(connection, queue_name.removeprefix(QUEUE_PREFIX), place, offset, per_page,
                                    newest_first=order == "dsc")
        return total, [row(connection, m, place) for m in members]

    def unreadable_job(e: Exception) -> Any:
        if isinstance(e, HTTPException):  # a 404 and the like: Flask's own answer
            return e
        jid = (request.view_args or {}).get("job_id")
        if jid is None:
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}, 500
        kind, why = job_kind(getattr(current_app, "redis_conn"), str(jid))  # noqa: B009 - set by rq-dashboard
        if kind is JobKind.EXPIRED:  # rq's normal life: no exc_info, so no Requeue button
            return {"id": jid, "status": "expired", "exc_info": None, "description": f"({why})"}, 200
        why = why or f"{type(e).__name__}: {str(e)[:200]}"
        return {"id": jid, "status": "malformed", "description": f"(malformed: {why})", "exc_info": why}, 200

    setattr(web, "get_queue_registry_jobs_count", jobs_page)  # noqa: B010
    web.blueprint.register_error_handler(Exception, unreadable_job)
