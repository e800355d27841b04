"""The workers' handoff components: P returns its own in the params and observes them; D observes the time
to a claimed ticket. Every clock is injected, so each duration is exact."""

from __future__ import annotations

import pytest

from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.metrics import Metrics
from pdserve.pd.leases import LeaseTable
from pdserve.pd.prefill import PrefillConnector, PrefillIdentity
from pdserve.pd.tickets import TicketAdmission
from pdserve.request import GenerationRequest
from pdserve.transfer.fake_transport import FakeFabric
from tests.pd.pd_pair import BLOCK, PLAN, FakeClock, PrefillSide, make_request
from tests.pd.test_tickets import InnerAdmission, Pair

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _handoff_sum(metrics: Metrics, component: str) -> float:
    return metrics.registry.get_sample_value("pdserve_pd_handoff_seconds_sum", {"component": component}) or 0.0


def test_p_returns_queue_compute_and_pin_times_of_its_own_clock_and_observes_them():
    side = PrefillSide(FakeFabric(), FakeClock())
    metrics = Metrics()
    clock = FakeClock(now_s=12.5)
    connector = PrefillConnector(side.transport, LeaseTable(30.0, clock=clock),
                                 PrefillIdentity("P", "epoch-1", "127.0.0.1", 1), PLAN, BLOCK, metrics.transfer,
                                 clock=clock)
    request = make_request("r1", 8, remote_decode=True, sampling=SamplingParams(max_tokens=1, temperature=0))
    request.arrival_time_s, request.first_scheduled_time_s, request.first_token_time_s = 10.0, 10.5, 12.25
    request.num_computed_tokens = 8
    tables = [[1, 2], [3, 4], [5, 6], [7, 8]]
    action = connector.request_finished(request, FinishReason.LENGTH, tables)
    assert action.kv_transfer_params.handoff_s == {"p_queue": 0.5, "p_compute": 1.75, "p_pin": 0.25}
    assert action.kv_transfer_params.to_wire()["handoff_s"]["p_compute"] == 1.75
    assert _handoff_sum(metrics, "p_queue") == 0.5 and _handoff_sum(metrics, "p_pin") == 0.25


class _SteppingClock:
    """Each reading is `step_s` after the one before."""

    def __init__(self, step_s: float):
        self.now_s = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        self.now_s += self.step_s
        return self.now_s


async def test_d_observes_admission_start_to_claimed_ticket():
    pair = Pair()
    params = pair.p.prefill("r1", 30)
    seen: list[float] = []
    admission = TicketAdmission(InnerAdmission(), pair.client, "recompute", clock=_SteppingClock(0.125),
                                observe_ticket_s=seen.append)
    prompt = tuple(range(10, 40))
    admitted = await admission.admit(GenerationRequest("d-req", prompt, SamplingParams(), kv_params=params))
    assert admitted.remote is not None and seen == [0.125]


def test_d_observes_each_pull_as_a_handoff_component():
    metrics = Metrics()
    metrics.transfer.observe_pull(4096, 4, 0.0625)
    assert _handoff_sum(metrics, "d_pull") == 0.0625
