"""How a rank's run ends (``train.train``'s one context): its exit code, and what every ending
does.

A refusal (``ConfigError``) is said once, in one sentence, and exits 2; any other exception is
recorded for the launcher (``rank<r>/error.json``: it names the cause) and goes on; a
``SystemExit`` (preemption, an interrupt) exits with its code; a clean end with 0. Then, however
it ended: the logger finishes, an agreed stop waits for every rank to flush, the exit is
recorded, and the process group is torn down. A multi-node rank's heartbeats (``reach``) run
inside it: a host gone silent ends the run from there, named.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

from ddp_template import distributed, reach
from ddp_template.config.schema import BackendConfig
from ddp_template.distributed import DistInfo
from ddp_template.errors import EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, EXIT_PREEMPTED, ConfigError
from ddp_template.process import exit_records
from ddp_template.sinks.console import say_refusal


class Ending:
    """The context a rank's run runs in: ``info`` and ``logger`` are the current membership's
    (``train.membership`` sets them)."""

    def __init__(self, run_dir: Path, info: DistInfo, backend: BackendConfig) -> None:
        self.run_dir, self.info, self.backend = run_dir, info, backend
        self.logger: Any = None  # sinks.metrics.RankLogger, once the first membership made it
        self.code = 1
        self.watch: reach.Watch | None = None

    def __enter__(self) -> Ending:
        self.watch = reach.watch(self.run_dir, self.info, self.backend)  # multi-node: heartbeats
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.watch is not None:  # leaving through train: this rank's silence is no loss
            self.watch.close()
        if exc is None:
            self.code = 0
        elif isinstance(exc, ConfigError):  # one sentence, no traceback: the message says the fix
            say_refusal(exc, self.info.rank)  # one every rank met alike: rank 0 says it
            self.code = EXIT_CONFIG_ERROR
        elif isinstance(exc, Exception):
            exit_records.record_failure(self.run_dir, self.info.rank, exc)  # the launcher's
        elif isinstance(exc, SystemExit):
            self.code = exc.code if isinstance(exc.code, int) else 1
        self.close()
        if isinstance(exc, ConfigError):
            raise SystemExit(EXIT_CONFIG_ERROR) from None

    def close(self) -> None:
        try:
            if self.logger is not None:
                self.logger.finish(self.code)
            if self.code in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
                # An agreed stop: a launcher ends the other ranks at the first non-zero exit, so
                # no rank leaves before every rank has flushed its logs and W&B run.
                distributed.barrier(self.info)
        finally:
            # Whatever failed above: a process that exits with its gloo group alive can abort
            # in the interpreter's shutdown ("terminate called without an active exception").
            exit_records.record_exit(self.run_dir, self.info.rank, self.code)
            distributed.teardown()
