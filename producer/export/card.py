"""The dataset card beside an export: a README.md in the Hugging Face Hub's convention, holding
what a person checks before training on the file (its sections' text: cardsection.py).

Its YAML header's `configs:` names the dataset file as the `train` split, so
`datasets.load_dataset(<folder>)` reads the dataset and none of its side files (errors,
truncated, missing, flagged, dataset_info.json, the pictures), and the Hub renders it.

Whose README.md: the card's first body line marks it as genqueue's (MARK). An export writes
README.md when the folder has none or has a genqueue card; beside a README.md of anyone else
(a project's root, a user's folder) it writes `<stem>.card.md` and says so. Several exports into
one folder share one card: each export is one section (between `genqueue:export` markers), one
`configs:` entry named after its stem, the latest the default; an export replaces the section of
an earlier one of the same stem (they share their side files too), and sections whose dataset
file is gone are dropped. The same export writes the same bytes: no clock is read.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from genqueue.common.keepers.captured import CaptureFigures, LogprobsFigures
from genqueue.common.keepers.runs import RunInfo
from genqueue.producer.export.cardsection import PLOTS_HINT, export_section, link
from genqueue.producer.export.plan import ExportResult
from genqueue.producer.export.rowstats import RowStats, read_rows, row_stats
from genqueue.producer.export.sinks import stem
from genqueue.producer.export.tempnames import sweep_dead, temp_beside
from genqueue.producer.outfiles import Target, write_failed

__all__ = ["CARD", "MARK", "PICTURE", "CardResult", "RowStats", "card_files", "card_path", "card_rows", "read_rows",
           "row_stats", "write_card"]

log = logging.getLogger(__name__)

#: The line that makes a README.md genqueue's card (and so one an export may rewrite).
MARK = ("<!-- genqueue dataset card: written by `producer export`, which rewrites it at the next export into this "
        "folder. Delete this line to keep the file as yours: exports then write <stem>.card.md beside it. -->")
_MARK_PREFIX = "<!-- genqueue dataset card"
_SECTION = re.compile(r"<!-- genqueue:export (\{.*?\}) -->\n(.*?)<!-- genqueue:end -->\n", re.DOTALL)
CARD = Target("dataset card", "write it elsewhere with --card-images for its pictures, or pass --no-card")
PICTURE = Target("card picture", "put the pictures elsewhere with --card-images, or pass --no-card")
#: The Hub's size_categories buckets (upper bounds, name).
_SIZES = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
          (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"))


# --- where the card goes ----------------------------------------------------------------------
def is_card(path: Path) -> bool:
    """PATH is a card genqueue wrote (its MARK line is there)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return any(line.startswith(_MARK_PREFIX) for line, _ in zip(fh, range(64), strict=False))
    except OSError:
        return False


def card_path(output: Path) -> tuple[Path | None, str]:
    """Where OUTPUT's card goes, and why there: README.md beside it when the folder has none or
    genqueue's; else <stem>.card.md (when that is free or genqueue's); else nowhere."""
    readme = output.parent / "README.md"
    if not readme.exists() or is_card(readme):
        return readme, ""
    other = output.parent / (stem(output).name + ".card.md")
    if not other.exists() or is_card(other):
        return other, (f"{readme} is not a genqueue card, so it is left as it is: the card is {other.name} "
                       "(name it README.md in a folder of its own to publish the dataset)")
    return None, f"{readme} and {other} are not genqueue cards: no card written"


def _plots() -> Any:
    """cardplots when it can draw (matplotlib installed), else None."""
    try:
        from genqueue.producer.export import cardplots
    except ImportError:
        return None
    return cardplots if cardplots.available() else None


def card_files(output: Path, images_dir: Path | None = None) -> tuple[Path | None, list[Path]]:
    """The card OUTPUT's export would write (card_path) and the pictures it may draw (none
    without matplotlib): known before anything is written, so none of them replaces a file that
    is not genqueue's."""
    path, _ = card_path(output)
    plots = _plots()
    if path is None or plots is None:
        return path, []
    folder = images_dir or path.parent
    return path, [plots.picture(folder, stem(output).name, kind) for kind in plots.KINDS]


# --- the card ---------------------------------------------------------------------------------
@dataclass
class CardResult:
    """What write_card wrote (the summary's `card`)."""

    path: str = ""
    images: list[str] = field(default_factory=list)
    note: str = ""
    rows: int = 0
    conversations: int = 0
    generations: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "images": self.images, "note": self.note, "rows": self.rows,
                "conversations": self.conversations, "generations": self.generations}


def write_card(result: ExportResult, info: RunInfo | None, *, images_dir: Path | None = None,
               incomplete: str = "", stats: RowStats | None = None,
               capture: CaptureFigures | None = None, logprobs: LogprobsFigures | None = None) -> CardResult:
    """Write the card of the export RESULT describes (its dataset already in place) from STATS,
    the count of the rows the export wrote (Exporter.written: the one count its summary reads
    too; None: one pass over the dataset file), the pictures (when matplotlib is installed), the
    card. CAPTURE: the run's capture figures (common/keepers/captured.py, status's too), for a
    --capture run; LOGPROBS: its tables' figures (the same module's), for a --logprobs run. INCOMPLETE:
    what the dataset lacks, in words, when the export was incomplete (items missing, or failed
    past --max-failed): the card says so first. The same export writes the same bytes: no clock
    is read."""
    output = Path(result.output)
    path, note = card_path(output)
    done = CardResult(note=note)
    if path is None:
        return done
    if stats is None:
        stats = row_stats(read_rows(output, parquet=result.container == "parquet"))
    done.rows, done.conversations, done.generations = stats.rows, stats.conversations, stats.generations
    config = _config_name(stem(output).name)
    pictures_dir = images_dir or path.parent
    pictures: dict[str, Path] = {}
    plots = _plots()
    if plots is not None:
        try:
            pictures = plots.draw(stats, pictures_dir, stem(output).name)
        except OSError as e:
            raise write_failed(e, pictures_dir, CARD) from None
    done.images = [str(p) for p in pictures.values()]
    links = {name: link(p, path.parent) for name, p in pictures.items()}
    section = export_section(result, info, stats, links, plots=plots is not None, folder=path.parent,
                             incomplete=incomplete, capture=capture, logprobs=logprobs)
    kind = "parquet" if result.container == "parquet" else "json"
    meta = {"config": config, "file": link(output, path.parent), "kind": kind, "rows": stats.rows,
            "thinking": bool(stats.thinking) or _has_thinking(info)}
    sections = [(m, body) for m, body in _sections(path) if m.get("config") != config
                and (path.parent / str(m.get("file", ""))).exists()]
    # datasets builds every config of a folder with the one builder its first config's files
    # name (json or parquet): the card lists the exports of this export's kind only
    other = [str(m.get("file")) for m, _ in sections if m.get("kind", "json") != kind]
    if other:
        sections = [(m, body) for m, body in sections if m.get("kind", "json") == kind]
        done.note = "; ".join(filter(None, [done.note, (
            f"the card no longer lists {', '.join(other)}: load_dataset reads one folder's configs with one "
            f"builder, and this export is {'Parquet' if kind == 'parquet' else 'JSON lines'}")]))
    sections.append((meta, section))
    text = _header(sections) + "\n" + MARK + "\n\n" + _intro(sections) + "".join(
        f"<!-- genqueue:export {_comment_json(m)} -->\n{body}<!-- genqueue:end -->\n" for m, body in sections)
    sweep_dead([path])
    tmp = temp_beside(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_failed(e, path, CARD) from None
    done.path = str(path)
    return done


def card_rows(card: CardResult | None) -> list[tuple[str, str]]:
    """The export summary's rows for the card (none with --no-card)."""
    if card is None:
        return []
    rows = [("card", card.path or "not written")]
    if card.images:
        rows.append(("  pictures", ", ".join(Path(p).name for p in card.images)))
    elif card.path:
        rows.append(("  pictures", f"none: matplotlib is not installed ({PLOTS_HINT})"))
    if card.note:
        rows.append(("  note", card.note))
    return rows


def _has_thinking(info: RunInfo | None) -> bool:
    return bool(info and info.settings.expect_reasoning)


def _config_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or "default"


def _comment_json(meta: Mapping[str, object]) -> str:
    # ">" only occurs inside JSON strings: escaped, no "-->" can close the comment early
    return orjson.dumps(meta).decode().replace(">", "\\u003e")


def _sections(path: Path) -> list[tuple[dict[str, Any], str]]:
    """The export sections of the card at PATH (none when it is not there)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for m in _SECTION.finditer(text):
        try:
            meta = orjson.loads(m.group(1))
        except orjson.JSONDecodeError:
            continue
        if isinstance(meta, dict):
            out.append((meta, m.group(2)))
    return out


def _header(sections: list[tuple[dict[str, Any], str]]) -> str:
    """The YAML header: one config per export (the latest the default), the Hub's tags."""
    lines = ["---", "configs:"]
    for i, (meta, _) in enumerate(sections):
        lines += [f"- config_name: {_q(str(meta['config']))}", "  data_files:", "  - split: train",
                  f"    path: {_q(str(meta['file']))}"]
        if i == len(sections) - 1 and len(sections) > 1:
            lines.append("  default: true")
    total = sum(int(m.get("rows") or 0) for m, _ in sections)
    size = next((name for bound, name in _SIZES if total < bound), "n>100M")
    tags = ["synthetic", "genqueue", *(["reasoning"] if any(m.get("thinking") for m, _ in sections) else [])]
    lines += ["task_categories:", "- text-generation", "tags:", *(f"- {t}" for t in tags),
              "size_categories:", f"- {size}", "---"]
    return "\n".join(lines) + "\n"


def _q(text: str) -> str:
    return orjson.dumps(text).decode()  # a JSON string is a YAML double-quoted scalar


def _intro(sections: list[tuple[dict[str, Any], str]]) -> str:
    names = ", ".join(f"`{m['config']}` ({m['file']})" for m, _ in sections)
    latest = sections[-1][0]
    more = (f" Each export is a config: {names}; the latest, `{latest['config']}`, is the default "
            f"(`load_dataset(folder, \"{sections[0][0]['config']}\")` for another).") if len(sections) > 1 else ""
    return ("# Dataset card\n\nGenerated with genqueue: what each export below holds, "
            "counted by `producer export` (its summary) and by one pass over the exported rows. "
            "`datasets.load_dataset(\"<this folder>\")` reads the dataset file only, as the `train` split; "
            f"the side files beside it are not loaded.{more}\n\n")
