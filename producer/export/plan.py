"""What one `producer export` writes (ExportPlan: its settings once checked) and what it did
(ExportResult: the summary, printed as a table or as --json, and read by the dataset card).

Every count of the result is made once, by the phase that sees it: pass 1 (partition.py) the
lines read, pass 2 (reduce.py) the items by outcome and what each --rows layout makes of them,
the failed jobs (failedjobs.py), the coverage check (coverage.py), and what the dataset holds
from the rows as the sink writes them (rowstats.RowStats, core.Exporter.written).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from genqueue.common import defaults
from genqueue.common.contracts import Outcome
from genqueue.common.variants import Variant
from genqueue.producer.export.formats import FORMATS, ExportFormat
from genqueue.producer.export.formats.spec import RowLayout

#: What the dataset holds by default: complete conversations whose every answer ended on its
#: own. A cut answer (every trainer closes each assistant turn with an end-of-turn token, so a
#: drafter would learn to stop mid-sentence) and a partial conversation go to the truncated
#: file; --include-outcomes opts them in.
DEFAULT_OUTCOMES = frozenset({Outcome.FINISHED.value})


@dataclass
class ExportResult:
    """What an export did: the coverage numbers, and where everything was written."""

    run: str
    format: str
    output: str
    errors_path: str
    missing_path: str
    source: str
    truncated_path: str = ""
    container: str = "jsonl"
    include_outcomes: list[str] = field(default_factory=list)
    shards: int = 0
    records_read: int = 0
    enqueued: int = 0
    exported: int = 0  # items with a row in the dataset (Exporter.written)
    truncated: int = 0
    complete: int = 0  # answered items by outcome, whichever file they went to: finished
    partial: int = 0  # regenerate: a later turn failed
    cut: int = 0  # any other outcome (cut by max_tokens, or no answer)
    # regenerate conversations with tool turns: regenerated to the end through the recorded
    # results, stopped at a divergence, stopped at a tool turn for another reason
    tool_turns_to_end: int = 0
    tool_call_diverged: int = 0
    stopped_at_tool_turn: int = 0
    failed: int = 0
    missing: int = 0
    duplicates_removed: int = 0
    failed_jobs: int = 0
    unexpected: int = 0
    bad_lines: int = 0
    bad_shards: int = 0
    groups: int = 0
    seconds: float = 0.0
    failed_by_class: dict[str, int] = field(default_factory=dict)
    truncated_by_outcome: dict[str, int] = field(default_factory=dict)
    #: Entries of the run's queue and registries that are no usable job (rqjobs.BadJob dicts).
    malformed_jobs: list[dict[str, str]] = field(default_factory=list)
    #: Jobs the consumers refused (job id -> reason), from genqueue:refused:<queue>.
    refused_jobs: dict[str, str] = field(default_factory=dict)
    cut_by_outcome: dict[str, int] = field(default_factory=dict)
    with_tools: bool = False  # a dataset row carries tools (LLaMA-Factory's entry then names the column)
    variant: str | None = None  # only this request variant's records were exported (--variant)
    by_variant: dict[str, int] = field(default_factory=dict)  # exported rows by request variant
    other_variants: int = 0  # items of the other variants, left out by --variant
    dataset_info_path: str = ""
    #: Quality gates (gates.py): dataset rows flagged, per reason (a row may have several);
    #: with --drop-flagged (and --only-target-turns) they went to the flagged file instead.
    flagged: int = 0
    flagged_by_reason: dict[str, int] = field(default_factory=dict)
    flagged_dropped: int = 0
    flagged_path: str = ""
    #: Dataset rows holding assistant turns the target did not write (modes each and last:
    #: the input's history answers), whichever file they went to.
    original_turns: int = 0
    #: --rows (genrows.py): the layout written; the dataset's rows (exported counts items) and the
    #: truncated file's; the dataset rows each layout makes of the same items; the generated
    #: thinking traces of the answered items and those each layout's dataset rows keep (a
    #: conversation row keeps those after its last user message, as Qwen3-style templates render).
    rows_layout: str = ""
    rows: int = 0
    truncated_rows: int = 0
    generation_rows: int = 0
    conversation_rows: int = 0
    traces: int = 0
    traces_kept_generation: int = 0
    traces_kept_conversation: int = 0
    #: Speculative-decoding acceptance of the answered items kept (each once), overall and by
    #: source, variant, turn and length (acceptance_summary); empty when no answer has figures.
    acceptance: dict[str, object] = field(default_factory=dict)
    #: What --weight-by-acceptance / --keep-lowest-acceptance did (stage.write_selected); empty
    #: without them. Its rows_left_out are out of the dataset (and of `rows`), not missing.
    selection: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ExportPlan:
    """What one export writes, and where: `producer export`'s settings once checked
    (command.export_plan builds it from the options and the run)."""

    #: the lines' shape (formats.FORMATS); PARQUET: the dataset file is Parquet
    fmt: ExportFormat
    output: Path
    errors_path: Path
    missing_path: Path
    #: where the partition files go (about the dataset's size)
    workdir: Path
    truncated_path: Path | None = None  # None: beside the output
    #: the outcomes the dataset holds; answers with another go to the truncated file
    include: frozenset[str] = DEFAULT_OUTCOMES
    parquet: bool = False
    group_samples: bool = False
    partition_bytes: int = defaults.EXPORT_PARTITION_BYTES
    #: mode each: a line's id names its turn (lines.line_id)
    per_turn_ids: bool = False
    #: the run's request variants, and the one whose records are kept (None: all)
    variants: tuple[Variant, ...] = ()
    variant: str | None = None
    drop_flagged: bool = False
    only_target_turns: bool = False
    flagged_path: Path | None = None  # None: beside the output, when rows are kept out
    #: --rows: a conversation-level format's lines per generation or per conversation (genrows.py)
    rows: RowLayout = RowLayout.GENERATION
    #: --weight-by-acceptance: a `sample_weight` per row; --keep-lowest-acceptance: the share of
    #: the rows with figures kept, lowest acceptance first (stage.py; None: every row)
    weight_by_acceptance: bool = False
    keep_lowest_acceptance: float | None = None

    @property
    def layout(self) -> RowLayout | None:
        """The --rows layout of a format whose lines are conversations; None: rows of its own."""
        return RowLayout(self.rows) if FORMATS[ExportFormat(self.fmt)].conversation_rows else None

    @property
    def selects(self) -> bool:
        """The dataset's rows go through selection by acceptance (pass 3)."""
        return self.weight_by_acceptance or self.keep_lowest_acceptance is not None
