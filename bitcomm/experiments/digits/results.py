"""What a train-digits run records per method: the one place that names its keys."""

from __future__ import annotations

import dataclasses

__all__ = ["MethodResult"]


@dataclasses.dataclass
class MethodResult:
    """One method trained over one transport, as every rank computes it (rank 0 writes it).

    Attributes:
        transport: ``"mpi"`` or ``"gloo"`` (empty until the rank program sets it).
        method: the method's name in :data:`bitcomm.experiments.digits.METHODS`.
        workers: ranks that trained together.
        steps: optimizer steps.
        curve: ``(step, test accuracy)`` pairs, every ``eval_every`` steps and at the end.
        accuracy: the last test accuracy.
        bytes_per_step: bytes one worker handed the transport per step.
        compression: what the fp32 allreduce's direct exchange sends per step over that.
        seconds: wall time of the training loop.
        params: model parameters.
        digest: the sum of the final parameters, compared across ranks.
        selected_ratio: for threshold-selecting methods (``selection`` on the optimizer), the
            mean over steps of the entries selected over the target k (rank 0's view).
        selected_deviation: the mean over steps of ``|selected / k - 1|``.
        identical_on_ranks: every rank ended with the same digest.
        baseline: the dense method it is compared with (set by :func:`summarise`).
        gap_points: the baseline's accuracy minus this one's, in points (likewise).

    """

    transport: str
    method: str
    workers: int
    steps: int
    curve: list[tuple[int, float]]
    accuracy: float
    bytes_per_step: float
    compression: float
    seconds: float
    params: int
    digest: float
    selected_ratio: float | None = None
    selected_deviation: float | None = None
    identical_on_ranks: bool = True
    baseline: str | None = None
    gap_points: float | None = None

    def as_dict(self) -> dict:
        """Return the fields as a JSON-ready dict (the rows of ``results.json``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MethodResult:
        """Return the result :meth:`as_dict` wrote."""
        return cls(**{**data, "curve": [tuple(p) for p in data["curve"]]})
