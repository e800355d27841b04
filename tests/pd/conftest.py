"""The fixtures of the two-sided P/D tests (tests/pd/pd_pair.py): a fake clock, a fake NIXL fabric,
a prefill side and a decode side connected to it. A module whose pair needs another plan overrides
`p` and `d` (tests/pd/test_state_handoff.py)."""

from __future__ import annotations

import pytest

from pdserve.transfer.fake_transport import FakeFabric
from tests.pd.pd_pair import DecodeSide, FakeClock, PrefillSide


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def fabric():
    return FakeFabric()


@pytest.fixture
def p(fabric, clock):
    return PrefillSide(fabric, clock)


@pytest.fixture
def d(fabric, clock, p):
    side = DecodeSide(fabric, clock)
    assert side.connect(p) is None
    return side
