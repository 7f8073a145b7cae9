"""An input's place in its run, bound into the Origin its items are made with.

The order of a run's sources and the inputs being read are kept in Redis by
common/keepers/runsources.py (RunSources).
"""

from __future__ import annotations

from dataclasses import replace

import redis

from genqueue.common.keepers.runsources import RunSources
from genqueue.common.requests import RequestShape
from genqueue.common.settings import RunSettings
from genqueue.producer.ingest.items import Origin

__all__ = ["bind"]


def bind(origin: Origin | None, path: str, source_id: str, run: str, settings: RunSettings,
         conn: redis.Redis | None) -> Origin:
    """ORIGIN (the enqueue command's --id-field and --samples) completed for one input of RUN:
    its name as given, its place (0 in a dry run: nothing is written), the run's seed and
    request parameters (a Batch line may ask for the token ids a --token-ids run asks for)."""
    params = RequestShape.of(settings).fields()
    return replace(origin or Origin(), source=path, source_seq=RunSources(conn, run).assign(source_id) if conn else 0,
                   base_seed=settings.sampling.seed or 0, run_params=params)
