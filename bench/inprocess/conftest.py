"""The model every microbenchmark here runs on: the embedded one, on the default engine, one thread."""

from __future__ import annotations

import pytest

from stopline.engine.loop import Engine


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(threads=1, progress=False)


@pytest.fixture(scope="module")
def slot(engine):
    slot = engine.open_slot()
    yield slot
    slot.close()
