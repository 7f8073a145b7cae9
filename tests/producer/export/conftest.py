"""The trainers' run, made once a session: test_trainer_loaders.py and
test_trainer_generation_rows.py read the same exports (a stand-in run of about a minute), and a
fixture of module scope made it once for each of them."""

from __future__ import annotations

import pytest

from tests.conftest import RedisServer


@pytest.fixture(scope="session")
def trainer_exports(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> object:
    from tests.producer.export.test_trainer_loaders import build_exports

    return build_exports(tmp_path_factory, redis_server)
