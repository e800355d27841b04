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


def test_each_pin_gets_its_own_nonce_and_only_it_holds_the_pin():
    table = LeaseTable(lease_s=30, clock=FakeClock())
    first = table.pin("a", 3)
    assert table.holds("a", first.nonce) and len(first.nonce) == 32
    assert not table.holds("a", "0" * 32) and not table.holds("b", first.nonce)
    table.release("a")
    second = table.pin("a", 3)  # the id is reused: the earlier pin's nonce holds nothing
    assert second.nonce != first.nonce
    assert table.holds("a", second.nonce) and not table.holds("a", first.nonce)


def test_renewals_never_extend_a_pin_past_its_longest_life():
    clock = FakeClock()  # t = 100
    table = LeaseTable(lease_s=30, clock=clock, max_pin_s=100)  # the pin ends by t = 200 whatever happens
    table.pin("a", 2)
    for now in (120, 140, 160, 180, 190):  # a reader renewing well within each lease
        clock.now = now
        assert table.renew(["a"]) == ["a"]
        assert table.expire() == []
    clock.now = 199.5
    assert table.expire() == []
    clock.now = 200
    assert table.expire() == ["a"] and table.num_pinned_blocks == 0
