from pdserve.pd.leases import LeaseTable


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lease_expires_after_its_length_unless_renewed():
    clock = FakeClock()
    table = LeaseTable(lease_s=30, clock=clock)
    table.pin("a", 4)
    table.pin("b", 2)
    assert table.num_pinned_blocks == 6
    clock.now += 20
    assert table.renew(["a", "unknown"]) == ["a"]
    clock.now += 15
    assert table.expire() == ["b"]
    assert table.num_pinned_blocks == 4
    clock.now += 30
    assert table.expire() == ["a"]
    assert table.num_pinned_requests == 0


def test_release_happens_exactly_once():
    table = LeaseTable(lease_s=30, clock=FakeClock())
    table.pin("a", 3)
    assert table.release("a") is True
    assert table.release("a") is False
    assert table.expire() == []
    assert "a" not in table
