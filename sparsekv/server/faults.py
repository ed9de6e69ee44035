"""Test-only fault injection: make one engine step raise (tests of step-failure isolation).

Installed only when the server starts with ``SPARSEKV_TEST_FAULT_MARKER`` set; a request whose
prompt text contains the marker then fails in its first step, exactly as a model error would.
"""

from __future__ import annotations

import threading

FAULT_MARKER_ENV = "SPARSEKV_TEST_FAULT_MARKER"


class StepFaultInjector:
    """Wraps ``runner.execute``: raise once in the first step that schedules a marked request.

    Args:
        runner: the engine's model runner (wrapped in place, before the engine loop starts).
    """

    def __init__(self, runner) -> None:
        self._execute = runner.execute
        self._marked: set[str] = set()
        self._lock = threading.Lock()
        runner.execute = self

    def mark(self, request_id: str) -> None:
        """Fail the first step that schedules ``request_id`` (or one of its samples)."""
        with self._lock:
            self._marked.add(request_id)

    def __call__(self, scheduled):
        ids = {item.request.request_id.split("#")[0] for item in scheduled.scheduled}
        with self._lock:
            hit = ids & self._marked
            self._marked -= hit
        if hit:
            raise RuntimeError(f"injected test fault for {sorted(hit)}")
        return self._execute(scheduled)
