"""How a round's updates become its mean: the aggregation rule and the verification of each update
(docs/training.md, "Robust aggregation and verification"). Configuration only, nothing imported from torch:
:mod:`parameter_server.job` parses it, :mod:`parameter_server.rounds.robust` applies it.

* ``mean`` (the default): the (sample-weighted) mean, streamed into one accumulator as updates arrive.
* ``clipped_mean``: each update's norm clipped to ``clip_factor`` × the round's median norm, then the
  (sample-weighted) mean.
* ``trimmed_mean``: per coordinate, the ``trim_fraction`` largest and smallest values dropped (at least one
  each side with 3 updates or more), the mean of the rest; unweighted.
* ``median``: the coordinate-wise median (the mean of the two middle values for an even count); unweighted.

Verification scores each update (its norm ÷ the round's median norm, its cosine similarity to the mean of
the others) and rejects one whose norm ratio is over ``max_norm_ratio`` or, with 3 updates or more, whose
cosine is under ``min_cosine``. It is on by default for the robust rules and off for ``mean``, so that a
``mean`` job behaves exactly as before.

Validation (``validation_every`` N, off by default; needs the job's eval data): in every round whose number
is a multiple of N, each update is also applied alone to the global weights (``θ + lr·Δ``, the outer step it
would take by itself, without momentum) and rejected when that raises the held-out loss above
``max_validation_rise`` × the global weights' loss (parameter_server/rounds/validation.py).

``discard_if_loss_rises`` (a ``rounds`` key, off by default; needs the eval data): a round whose outer step
raises the held-out loss above this factor × the previous round's is discarded: the previous weights and
momentum stay, and its result is u = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

MEAN = "mean"
CLIPPED_MEAN = "clipped_mean"
TRIMMED_MEAN = "trimmed_mean"
MEDIAN = "median"
AGGREGATIONS = (MEAN, CLIPPED_MEAN, TRIMMED_MEAN, MEDIAN)

DEFAULT_CLIP_FACTOR = 2.0
DEFAULT_TRIM_FRACTION = 0.25
#: An update whose norm is more than this many times the round's median norm is rejected.
DEFAULT_MAX_NORM_RATIO = 10.0
#: With 3 updates or more, one whose cosine similarity to the mean of the others is under this is rejected
#: (an honest update points roughly the same way as the others: positive cosines).
DEFAULT_MIN_COSINE = -0.5
#: A validated update is rejected when, applied alone, it raises the held-out loss above this factor.
DEFAULT_MAX_VALIDATION_RISE = 1.5

ACCEPTED = "accepted"
DOWN_WEIGHTED = "down-weighted"
REJECTED = "rejected"


@dataclass(frozen=True)
class Verification:
    """``rounds.verification``: ``enabled`` None means the rule's default (on for the robust rules);
    ``validation_every`` None: no validation step."""

    enabled: bool | None = None
    max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO
    min_cosine: float = DEFAULT_MIN_COSINE
    validation_every: int | None = None
    max_validation_rise: float = DEFAULT_MAX_VALIDATION_RISE

    def validates(self, round_number: int) -> bool:
        """Whether round ``round_number`` runs the validation step: a multiple of ``validation_every``."""
        return self.validation_every is not None and round_number % self.validation_every == 0


@dataclass(frozen=True)
class AggregationRule:
    """``rounds.aggregation`` with its options (see the module docstring)."""

    name: str = MEAN
    clip_factor: float = DEFAULT_CLIP_FACTOR
    trim_fraction: float = DEFAULT_TRIM_FRACTION
    verification: Verification = Verification()
    #: ``rounds.discard_if_loss_rises``: discard a round whose held-out loss rises above this factor × the
    #: previous round's (None: never).
    discard_if_loss_rises: float | None = None

    @property
    def verifies(self) -> bool:
        """Whether updates are scored and may be rejected."""
        enabled = self.verification.enabled
        return self.name != MEAN if enabled is None else enabled

    @property
    def holds_updates(self) -> bool:
        """Whether the round needs every update at once when it closes (they stay spooled until then), rather
        than a running sum: every rule but an unverified ``mean`` without validation."""
        return self.name != MEAN or self.verifies or self.verification.validation_every is not None

    @property
    def evaluates(self) -> bool:
        """Whether rounds need the held-out loss (validation or the discard rule): the job's eval data."""
        return self.verification.validation_every is not None or self.discard_if_loss_rises is not None
