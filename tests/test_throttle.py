"""A warning a flood would repeat is written at most once an interval."""

from __future__ import annotations

from stopline.protocol.throttle import Throttle


def test_a_throttled_warning_is_due_once_an_interval_unless_it_must_be_written():
    throttle = Throttle(interval_s=1.0)
    assert [throttle.due(at) for at in (100.0, 100.5, 100.999)] == [True, False, False]
    assert throttle.due(101.0)
    assert throttle.due(101.2, always=True)  # a shutdown's last count, say
    assert not throttle.due(102.1)  # the interval runs from the last line written
    assert throttle.due(102.2)
