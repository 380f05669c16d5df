"""The one exception type for bad input (config, data path, checkpoint).

Its message is one sentence that names the key, the bad value and the fix; ``train.py`` prints
it without a traceback and exits with ``EXIT_CONFIG_ERROR``.
"""

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EXIT_CONFIG_ERROR = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a scheduler should requeue the job
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_HOST_LOST = 69  # EX_UNAVAILABLE: a host of the run went silent (reach.Watch)
EXIT_FENCED = 70  # this rank was cut off from the run and stopped without writing (reach.Watch)


class ConfigError(ValueError):
    """Bad input detected at startup; the message is meant for the user as is."""


class Unanimous(ConfigError):
    """A refusal every rank meets alike, decided from what every rank holds the same (the one
    checkpoint every rank loads, the config): said once, by rank 0 (``sinks.console``)."""


@contextmanager
def unanimous() -> Iterator[None]:
    """A ``ConfigError`` raised inside becomes ``Unanimous``."""
    try:
        yield
    except Unanimous:
        raise
    except ConfigError as exc:
        raise Unanimous(str(exc)) from None


def require(ok: bool, message: str) -> None:
    """A startup check: ``message`` (one sentence: key, value, fix) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


class Misfit(ValueError):
    """A checkpoint part's saved state that this run's part cannot take: one sentence, which
    the checkpoint prefixes with the file's path."""


class Guarded:
    """A torch object (a module, a GradScaler) as a checkpoint part: the RuntimeError of its
    ``load_state_dict`` becomes a ``Misfit`` saying ``misfit(the first line of torch's)``."""

    def __init__(self, target: Any, misfit: Callable[[str], str]) -> None:
        self.target, self.misfit = target, misfit

    def state_dict(self) -> dict[str, Any]:
        return self.target.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.target.load_state_dict(state)
        except RuntimeError as exc:
            raise Misfit(self.misfit(str(exc).splitlines()[0][:100])) from None


def instantiate_clean(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that lets our own one-sentence ConfigError through unwrapped."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, ConfigError):
            raise exc.__cause__ from None
        raise


def command(main: Callable[..., None]) -> Callable[..., int]:
    """A command line's ``main``: exit status 0 when it returns, ``EXIT_CONFIG_ERROR`` with its
    refusal said in one line on stderr (``error: …``), no traceback."""

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> int:
        try:
            main(*args, **kwargs)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        return 0

    return run
