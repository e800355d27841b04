"""Every engine built by these tests checks the scheduler's invariants after each step of its loop
(module scope, so that engines built by module-scoped fixtures check too)."""

from __future__ import annotations

import pytest

from pdserve.app.engine_factory import CHECK_INVARIANTS_ENV


@pytest.fixture(scope="module", autouse=True)
def check_scheduler_invariants_after_every_step():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CHECK_INVARIANTS_ENV, "1")
        yield
