"""`RequestBook`: what every engine does with its requests outside the forward pass.

`LLMEngine` and the simulated replica (`server/sim_engine.py`, which must stay torch-free) both
keep a scheduler, an output processor and the outputs made between steps (aborts); how a
request is aborted, whether work is left, the stats and new ids are the same for both, so they
are written once here. The engine class sets `scheduler`, `output_processor`, `_pending`,
`_ids` and its `clock`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from inferlab.engine.output_processor import OutputProcessor
from inferlab.engine.outputs import SchedulerStats
from inferlab.engine.request import RequestOutput, RequestStatus
from inferlab.engine.scheduler import Scheduler


class RequestBook:
    scheduler: Scheduler
    output_processor: OutputProcessor
    _pending: list[RequestOutput]  # outputs produced outside step() (aborts), returned by the next step
    _ids: itertools.count
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def abort_request(self, request_ids: list[str] | str, reason: str = "abort", error: str | None = None) -> None:
        """Finish requests now (client gone, deadline): blocks freed; a final output with
        finish_reason `reason` comes out of the next step()."""
        status = RequestStatus.FINISHED_ERROR if reason == "error" else RequestStatus.FINISHED_ABORTED
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.finish_requests(self.output_processor.child_ids(rid), status)
            out = self.output_processor.abort(rid, self.clock(), reason, error)
            if out is not None:
                self._pending.append(out)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"
