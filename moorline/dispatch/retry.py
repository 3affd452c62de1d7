"""Retry policy: exponential backoff with full jitter, attempt budgets, non-retryable errors.

Pure functions over values, no I/O: the worker asks the policy what to do with a failed attempt
and writes the answer with one fenced statement.

Full jitter (a delay drawn uniformly from ``[0, min(cap, base · 2^(attempt-1))]``) rather than
a fixed exponential: when many runs fail together (a provider outage) fixed delays bring them
back together too, while full jitter spreads them over the whole window.
"""

import random
from dataclasses import dataclass

from moorline.db.repos.interrupts import InterruptMismatch
from moorline.db.repos.steps import StepMismatch
from moorline.errors import BudgetExceeded, ConfigError, SoftTimeLimitExceeded, WorkflowNotFound

DEFAULT_BASE_S = 1.0
DEFAULT_CAP_S = 300.0

DEFAULT_NON_RETRYABLE: tuple[type[BaseException], ...] = (
    ConfigError,
    TypeError,
    NotImplementedError,
    StepMismatch,
    InterruptMismatch,
    WorkflowNotFound,
    SoftTimeLimitExceeded,
)
"""Errors a retry cannot cure: configuration and programming mistakes (a workflow called
with the wrong arguments, a missing implementation, a workflow this worker's app lacks),
non-deterministic replays (a step or interrupt key recorded for another call), and a soft time
limit the workflow let escape (another attempt would run out of time the same way) fail the
run at once."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryDecision:
    """What to do with a failed attempt: retry after ``delay_s``, or fail the run."""

    retry: bool
    delay_s: float
    reason: str
    """``"retry"``, ``"max attempts"``, ``"non-retryable"`` or ``"budget"``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Backoff and retryability for the attempts of one workflow.

    Attributes:
        base_s: Upper bound of the first delay, in seconds.
        cap_s: Largest upper bound any delay may have, in seconds.
        non_retryable: Exception classes (and their subclasses) that fail a run at once.
    """

    base_s: float = DEFAULT_BASE_S
    cap_s: float = DEFAULT_CAP_S
    non_retryable: tuple[type[BaseException], ...] = DEFAULT_NON_RETRYABLE

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.cap_s < 0:
            raise ConfigError(
                f"retry backoff must not be negative (base {self.base_s}s, cap {self.cap_s}s)"
            )
        if self.cap_s < self.base_s:
            raise ConfigError(f"retry backoff cap {self.cap_s}s is below its base {self.base_s}s")

    def ceiling_s(self, attempt: int) -> float:
        """The upper bound of the delay after failed attempt number ``attempt`` (from 1)."""
        if attempt < 1:
            raise ValueError(f"attempts count from 1, got {attempt}")
        # Past 2^63 the float is huge anyway; bounding the exponent keeps it finite.
        return min(self.cap_s, self.base_s * 2.0 ** min(attempt - 1, 62))

    def next_delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait after failed attempt ``attempt``: uniform in ``[0, ceiling]``."""
        return rng.uniform(0.0, self.ceiling_s(attempt))

    def is_exhausted(self, attempt: int, max_attempts: int) -> bool:
        """Whether attempt ``attempt`` was the last one ``max_attempts`` allows."""
        return attempt >= max_attempts

    def is_retryable(self, exc: BaseException) -> bool:
        """Whether ``exc`` may be cured by running the attempt again."""
        return not isinstance(exc, self.non_retryable)

    def decide(
        self, exc: BaseException, attempt: int, max_attempts: int, rng: random.Random
    ) -> RetryDecision:
        """The fate of a run whose attempt ``attempt`` raised ``exc``."""
        if isinstance(exc, BudgetExceeded):
            # Whatever the workflow's own policy: another attempt today is refused the same way.
            return RetryDecision(retry=False, delay_s=0.0, reason="budget")
        if not self.is_retryable(exc):
            return RetryDecision(retry=False, delay_s=0.0, reason="non-retryable")
        if self.is_exhausted(attempt, max_attempts):
            return RetryDecision(retry=False, delay_s=0.0, reason="max attempts")
        return RetryDecision(retry=True, delay_s=self.next_delay(attempt, rng), reason="retry")
