"""`producer enqueue`: read an input, convert it once, account for every record, and enqueue rq
jobs (enqueue_file; what it did: summary.py's Summary).

Re-running the same command is the reconcile (reconcile.py): it enqueues exactly the items that
have no shipped result and are not queued, held or scheduled in rq, and reads nothing when
nothing can need doing (unchanged.py). Nothing is written to Redis until the input was opened
and its first records read, the run's settings checked against an existing run of that name (or
against the run.json its output holds, when Redis lost the run: runsetup.py), the input known
as the run's own (reconcile.other_input), the Redis memory the run will take estimated and
where its jobs keep their items chosen (memplan.py: inline in Redis, or by reference in packs
in the run's output), and the output and the side files probed: a mistyped path or option, or
a Redis too small, leaves no run behind. Then the Enqueuer (enqueuer.py) reads the input on,
and the source's summary is recorded in the run (and its run.json).

A write that fails (a full disk, a store that refuses a pack) or a Redis that fills up part way
ends the enqueue with one line saying what was queued before it; what was queued stays queued,
and the same command queues the rest.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from genqueue.common import defaults
from genqueue.common.contracts import PromptMode
from genqueue.common.errors import InputError, UserError, WriteFailedError
from genqueue.common.keepers.items import ITEMS_PER_BUCKET, ItemTable, buckets_for
from genqueue.common.keepers.redismem import RedisFilledError, check_policy, full_line, is_oom, read_memory
from genqueue.common.keepers.runlock import RunLock
from genqueue.common.keepers.runs import RunStore
from genqueue.common.keepers.runsources import RunSources
from genqueue.common.settings import RunSettings
from genqueue.common.storage import probe_output, store_for
from genqueue.producer.enqueue import memplan
from genqueue.producer.enqueue.enqueuer import Enqueuer
from genqueue.producer.enqueue.jobwriter import JobWriter
from genqueue.producer.enqueue.memplan import PromptsAsked
from genqueue.producer.enqueue.order import LongestFirst
from genqueue.producer.enqueue.reconcile import QueueView, derivation, input_digest, input_head, other_input
from genqueue.producer.enqueue.runsetup import Note, RunSetup, prepare
from genqueue.producer.enqueue.summary import Summary
from genqueue.producer.enqueue.unchanged import settled_unread
from genqueue.producer.ingest.inputcheck import checked
from genqueue.producer.ingest.items import Origin
from genqueue.producer.ingest.reader import RawRecord, iter_records
from genqueue.producer.ingest.rejects import RejectsWriter
from genqueue.producer.ingest.sources import bind
from genqueue.producer.outfiles import OUTPUT_DIR, REJECTS, probe, refuse_replacing

log = logging.getLogger(__name__)

#: Items a run is sized for when its input's size is unknown (stdin, a compressed file).
ITEMS_UNKNOWN_SIZE = 1_000_000


@dataclass(frozen=True, slots=True)
class EnqueueOptions:
    """How one enqueue reads its input and queues it; the recipe is the run's RunSettings."""

    #: items per rq job (None: memplan.choose_batch's, by the mode and the run's size)
    batch_size: int | None = None
    #: where rejected records are written (None: nowhere)
    rejects_path: str | None = None
    max_record_bytes: int = defaults.MAX_RECORD_BYTES
    #: queue the costliest items first, held in TMP_DIR (None: TMPDIR) until the input is read
    longest_first: bool = False
    tmp_dir: str | None = None
    #: how a record's id and samples are found (None: the defaults of Origin)
    origin: Origin | None = None
    #: queue items that have only an error record again
    retry_failed: bool = False
    #: give an existing run these settings instead of refusing them
    update_settings: bool = False
    #: a local output is one filesystem every node mounts (common/placement.py)
    shared_fs: bool = False
    #: give the run this priority before any job is queued (None: keep it)
    priority: int | None = None
    #: prove the output can be written and read back before anything is queued (probe_output)
    output_check: bool = True
    #: the settings the command line gave (common/settings.py's SETTING_NAMES): an existing
    #: run keeps its own for the others (runsetup.prepare); None: every one was given
    settings_given: frozenset[str] | None = None
    #: where the jobs keep their items: inline (in Redis), by reference (packs in the output), or
    #: auto: the run's mode, else by the input's size (memplan.choose_prompts)
    prompts: PromptsAsked = PromptsAsked.AUTO
    #: auto queues by reference from this many items of the input's estimate
    prompts_reference_from: int = defaults.PROMPTS_REFERENCE_FROM
    #: the items the whole run will hold, all its enqueues together (--expect-items; None: this
    #: input's): the item table of a new run is sized for them, and auto chooses by them
    expect_items: int | None = None


def enqueue_file(path: str, run: str, settings: RunSettings, conn: redis.Redis | None,
                 options: EnqueueOptions | None = None, *,
                 progress: Callable[[Iterator[RawRecord]], Iterator[RawRecord]] | None = None,
                 note: Note | None = None) -> Summary:
    """Enqueue PATH into RUN (or, with conn=None, only count what would be enqueued): the items
    with no shipped result that are not queued in rq (module docstring), as OPTIONS say.
    PROGRESS wraps the records read; NOTE gets the lines worth telling the user (a run
    re-created from its output, settings updated). A file that cannot be written raises
    WriteFailedError (outfiles)."""
    opts = options if options is not None else EnqueueOptions()
    started = time.perf_counter()
    if conn is not None:  # a Redis that evicts keys would drop the run in silence
        check_policy(conn, warn=(lambda line: note(f"warning: {line}")) if note is not None else log.warning)
    # a conflicting run is refused before the input is read; nothing is written yet
    setup: RunSetup | None = prepare(conn, run, settings, update=opts.update_settings, shared_fs=opts.shared_fs,
                                     given=opts.settings_given) if conn is not None else None
    if setup is not None:  # an existing run's own settings for those the command line left out
        settings = setup.settings
    summary = Summary(run=run, source=source_id(path), fingerprint=settings.fingerprint, dry_run=conn is None)
    records = iter_records(path, max_record_bytes=opts.max_record_bytes)  # a missing file raises here
    if settings.prefill is None:  # a capture pass's input is producer capture's own (ingest/prefill.py)
        records = checked(records, "stdin" if path == "-" else path)  # no JSON object ahead: refused
    head, records, complete = memplan.sample(records)  # what the run takes of Redis, before any write
    summary.input_head = input_head(head)
    if conn is not None and setup is not None:  # nothing is written yet: an input not the run's is refused
        _refuse_other_input(path, summary.source, head, setup, opts)
    est = memplan.estimate(path, head, settings, opts.origin, complete=complete)
    has = memplan.run_mode(conn, run, in_redis=setup.existing is not None, run_file=setup.run_file) \
        if conn is not None and setup is not None else None
    choice = memplan.choose_prompts(opts.prompts, est, has, reference_from=opts.prompts_reference_from,
                                    expected=opts.expect_items)

    def planned(by_reference: bool) -> memplan.MemoryPlan:
        return memplan.plan(path, head, run, settings, opts.origin, conn, complete=complete,
                            by_reference=by_reference, est=est)

    mem = planned(choice.mode is PromptMode.REFERENCE)
    choice, mem = memplan.choose_by_room(choice, mem, lambda: planned(True))
    summary.prompts, summary.prompts_choice = choice.mode.value, choice.fields()
    batch = memplan.choose_batch(opts.batch_size, choice.mode, est, expected=opts.expect_items)
    summary.batch_size, summary.batch_choice = batch.size, batch.fields()
    summary.redis_memory, summary.redis_estimate_bytes = mem.line(), mem.bytes
    summary.redis_free_bytes = mem.memory.free if mem.memory is not None else None
    if conn is not None:
        log.info("run %s: Redis memory %s", run, mem.line())
        memplan.refuse_unfit(mem, run)
    # Side files are opened (their place probed) before the run is created: a place that cannot
    # take them is refused with nothing written (outfiles.probe).
    if conn is not None and "://" not in settings.output and os.path.isdir(settings.output):
        # run.json goes there (runsetup), and this host's consumers' shards: a full one is refused
        probe(Path(settings.output) / f".gq-probe-{os.getpid()}", OUTPUT_DIR, shown=Path(settings.output),
              only_full=True)
    if conn is not None and opts.output_check:
        probe_output(settings.output, run)  # one probe per enqueue, before Redis holds anything of it
    rejects = RejectsWriter(opts.rejects_path).open() if opts.rejects_path else None
    order: LongestFirst | None = None
    try:
        order = LongestFirst(opts.tmp_dir) if opts.longest_first else None
        if conn is not None:  # after every probe: a refused enqueue leaves nothing in Redis
            _item_table(conn, run, mem, expect=opts.expect_items, note=note)
        return _enqueue(path, records, summary, run, settings, conn, setup, opts, started=started, rejects=rejects,
                        progress=progress, order=order, note=note, prompts=choice.mode)
    except WriteFailedError as e:
        done = "nothing was queued" if not summary.items else \
            f"{summary.items:,} items were queued before it and stay queued"
        raise WriteFailedError(f"{e} ({done}; the same command again queues the rest)") from None
    except redis.exceptions.ResponseError as e:
        if not is_oom(e) or conn is None:
            raise
        raise RedisFilledError(_filled_line(conn, summary)) from None
    finally:
        if rejects is not None:
            rejects.discard()  # a no-op once closed
        if order is not None:
            order.close()


def _refuse_other_input(path: str, source: str, head: list[RawRecord], setup: RunSetup, opts: EnqueueOptions) -> None:
    """Refuse, before anything is written, an input that is not the file the run was made from
    (reconcile.other_input), and a rejects file that would replace one the run reads or one
    genqueue did not write (outfiles.refuse_replacing)."""
    run = setup.run
    known: dict[str, dict[str, Any]] = {}
    if setup.existing is not None:
        known = RunStore(setup.conn).sources(run)
    elif setup.run_file is not None:  # Redis lost the run: run.json kept its sources
        known = {k: v for k, v in setup.run_file.sources.items() if isinstance(v, dict)}
    why = other_input(path, source, head, known, run, retry_failed=opts.retry_failed)
    if why is not None:
        raise UserError(why)
    rejects = Path(opts.rejects_path).absolute() if opts.rejects_path else None
    if rejects is not None and (rejects.is_file() or not rejects.exists()):  # /dev/null, a pipe: written as is
        inputs = {s: f"an input of run {run}" for s in known}
        if path != "-":
            inputs[path] = "the input of this enqueue"
        refuse_replacing([(rejects, REJECTS)], inputs=inputs, asked="remove it")


def _item_table(conn: redis.Redis, run: str, mem: memplan.MemoryPlan, *, expect: int | None = None,
                note: Note | None = None) -> None:
    """RUN's item table sized for the whole input, or for EXPECT items when --expect-items says
    how many the run will hold in all (fixed by a run's first enqueue; an input of unknown size
    gets the size of one whose first records were all it held), and the sets of a run queued by
    a genqueue before the table moved into it."""
    table = ItemTable(conn, run)
    wanted = mem.items if mem.whole else max(mem.items, ITEMS_UNKNOWN_SIZE)
    buckets = table.ensure(max(wanted, expect or 0))
    held, entries = table.counts().in_run, table.listpack_entries()
    if expect is not None and buckets < buckets_for(expect):
        line = (f"note: run {run}: --expect-items {expect:,} does not change its item table, sized by its first "
                f"enqueue ({buckets:,} buckets, for about {buckets * ITEMS_PER_BUCKET:,} items); give it "
                "to a run's first enqueue")
        (note or log.warning)(line)
    if held + mem.items > buckets * entries:
        cost = ("its buckets hold more than %d records each, past what they were made for: each claim and mark "
                "searches and copies longer strings, slower in Redis, the bytes an item unchanged" if table.blobs() else
                "its buckets outgrow Redis's compact hashes (%d entries): more Redis an item than the estimate's, "
                "nothing else changes")
        log.warning("run %s: its item table has %d buckets, fixed by its first enqueue; with about %s items more "
                    "than its %s " + cost + " (a run fed in parts is sized for all of them by --expect-items on "
                    "its first enqueue)", run, buckets, f"{mem.items:,}", f"{held:,}", entries)
    if moved := table.migrate_sets():
        log.warning("run %s: %d marks moved from the run's sets into its item table (made by an earlier "
                    "genqueue)", run, moved)


def _enqueue(path: str, records: Iterator[RawRecord], summary: Summary, run: str, settings: RunSettings,
             conn: redis.Redis | None, setup: RunSetup | None, opts: EnqueueOptions, *, started: float,
             rejects: RejectsWriter | None, progress: Callable[[Iterator[RawRecord]], Iterator[RawRecord]] | None,
             order: LongestFirst | None, note: Note | None, prompts: PromptMode) -> Summary:
    """enqueue_file once its input is checked and its side files are open; PROMPTS: where the
    jobs keep their items, as chosen."""
    batch_size = summary.batch_size
    priority, retry_failed = opts.priority, opts.retry_failed
    store = RunStore(conn) if conn is not None else None
    if setup is not None and store is not None:
        info = setup.apply(note or _log_note, priority)  # the priority is set before the first job
        summary.priority = int(setup.outcome["priority"])
        summary.fingerprint = info.fingerprint
        summary.created_run = bool(setup.outcome.get("created_run"))
        summary.recreated_run = bool(setup.outcome.get("recreated_run"))
        summary.marks_rebuilt = setup.outcome.get("marks_rebuilt")
        summary.settings_updated = setup.outcome.get("settings_updated")
    origin = bind(opts.origin, path, summary.source, run, settings, conn)
    lock = RunLock(conn, run) if conn is not None else None
    view: QueueView | None = None  # taken by the check below, under the lock, when it read no input
    if conn is not None and lock is not None:
        summary.input_digest = input_digest(path)
        summary.derivation = derivation(summary.fingerprint, opts.max_record_bytes, repr(origin))
        if setup is not None and setup.existing is not None and not retry_failed and not summary.settings_updated:
            try:
                unchanged, view = settled_unread(conn, run, summary, settings.output, lock)
            except BaseException:
                lock.release()
                raise
            if unchanged:
                summary.seconds = round(time.perf_counter() - started, 3)
                RunStore(conn).record_source(run, summary.source, summary.to_dict())
                return summary
    if progress is not None:
        records = progress(records)
    pack_store = store_for(settings.output) if prompts is PromptMode.REFERENCE and conn is not None else None
    writer = JobWriter(run, conn, batch_size=batch_size, lock=lock, pack_store=pack_store) \
        if conn is not None else None
    # a view the check above took stands: the lock was held since (it took over claims)
    enq = Enqueuer(run, settings, writer, batch_size=batch_size, rejects=rejects, order=order, origin=origin,
                   retry_failed=retry_failed, view=view)
    ended = False
    if conn is not None:
        RunSources(conn, run).start_reading(summary.source, time.time())
    try:
        enq.process(records)
        summary.complete = ended = True
    except InputError:  # the input broke part way: what came before it stands, its rejects too
        ended = True
        raise
    finally:
        try:
            enq.close(abandon=not summary.complete)  # the slices in flight: jobs landed or claims given back
        except Exception as e:  # only when another error is on its way up (else raised)
            if summary.complete:
                raise
            log.warning("enqueue of run %s: the last slice's write failed too: %s", run, e)
        finally:
            if lock is not None:
                lock.release()
            if conn is not None:
                RunSources(conn, run).end_reading(summary.source)
        enq.fill(summary)
        if writer is not None:
            summary.packs = len(writer.pack_names)
        try:
            if rejects is not None and ended:
                rejects.close()  # in place only now; otherwise enqueue_file removes its .partial
        finally:
            summary.rejects_path = rejects.path if rejects is not None and rejects.written else None
            summary.seconds = round(time.perf_counter() - started, 3)
            if store is not None and summary.records:
                store.record_source(run, summary.source, summary.to_dict())
                if setup is not None:
                    setup.record_source(summary.source, summary.to_dict(),
                                        packs=writer.pack_names if writer is not None else None)
    return summary


def _filled_line(conn: redis.Redis, summary: Summary) -> str:
    """What to say when Redis filled up part way: how far the enqueue got, and how to finish."""
    try:
        mem = read_memory(conn)
    except redis.exceptions.RedisError:
        mem = None
    what = full_line(mem) if mem is not None and mem.limited else "Redis is full (it refuses writes: used memory > maxmemory)"
    done = f"{summary.items:,} items were queued in {summary.jobs:,} jobs before it and stay queued" \
        if summary.items else "nothing was queued"
    return (f"{what}; {done}; free memory or raise maxmemory (`redis-cli CONFIG SET maxmemory ...`), then the "
            "same command queues the rest (it queues only what is not queued yet)")


def _log_note(line: str) -> None:
    log.warning("%s", line.split(": ", 1)[-1])


def source_id(path: str) -> str:
    """A name for an input that is the same when the same file is enqueued again."""
    return "-" if path == "-" else os.path.abspath(path)
