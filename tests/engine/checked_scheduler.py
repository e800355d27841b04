"""A `Scheduler` that checks its invariants after every call that changes it (the scheduler tests'
scheduler): a step that breaks one fails the test at that step, naming the rule."""

from __future__ import annotations

from pdserve.engine.scheduler import Scheduler


class CheckedScheduler(Scheduler):
    def add_request(self, request):  # type: ignore[no-untyped-def]
        super().add_request(request)
        self.check_invariants()

    def schedule(self):  # type: ignore[no-untyped-def]
        output = super().schedule()
        self.check_invariants()
        return output

    def update(self, output, sampled, prompt_logprobs=()):  # type: ignore[no-untyped-def]
        changed = super().update(output, sampled, prompt_logprobs)
        self.check_invariants()
        return changed

    def apply_kv_events(self, events):  # type: ignore[no-untyped-def]
        super().apply_kv_events(events)
        self.check_invariants()

    def finish(self, request_id, reason, error=None):  # type: ignore[no-untyped-def]
        request = super().finish(request_id, reason, error)
        self.check_invariants()
        return request

    def take_ticket(self, request_id, key, remote, first_token, pd_recomputed):  # type: ignore[no-untyped-def]
        taken = super().take_ticket(request_id, key, remote, first_token, pd_recomputed)
        self.check_invariants()
        return taken
