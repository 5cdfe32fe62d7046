"""Error feedback: what compression dropped this step is added back before the next one.

For each tensor ``key`` a residual ``e`` (zero at first) is kept; a step compresses
``c = g + e`` instead of ``g``, and afterwards ``e = c - sent``, where ``sent`` is ``c`` as the
receivers decode it. Nothing is lost, only delayed (RedSync, Alg. 4's
residual accumulation; the same idea as 1-bit Adam's worker error).

Example::

    fb = ErrorFeedback()
    c = fb.compensate("w", torch.tensor([0.3, -1.2]))    # tensor([0.3, -1.2]) (e = 0)
    fb.update("w", c, torch.tensor([0.0, -1.0]))          # e = [0.3, -0.2]
    fb.compensate("w", torch.tensor([0.1, 0.1]))          # tensor([0.4, -0.1])
"""

from __future__ import annotations

import torch

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Residuals of error feedback, one per tensor key; saved with ``state_dict``."""

    __slots__ = ("residuals",)

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, g: torch.Tensor) -> torch.Tensor:
        """Return ``g`` plus the residual kept for ``key`` (a new tensor; ``g`` is unchanged)."""
        e = self.residuals.get(key)
        if e is None:
            return g.detach().to(torch.float32, copy=True)
        if e.shape != g.shape:
            raise ValueError(f"residual {key!r} has shape {tuple(e.shape)}, the tensor "
                             f"{tuple(g.shape)}: one ErrorFeedback per tensor layout")
        return g.detach().to(torch.float32) + e

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep ``compensated - sent`` as ``key``'s residual."""
        if compensated.shape != sent.shape:
            raise ValueError(f"expected sent with shape {tuple(compensated.shape)}, got "
                             f"{tuple(sent.shape)}")
        self.residuals[key] = (compensated - sent.to(compensated.dtype)).detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return copies of the residuals."""
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore residuals saved by :meth:`state_dict`."""
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                                  for v in state.values()):
            raise TypeError("expected a dict of tensors from ErrorFeedback.state_dict()")
        self.residuals = {k: v.clone() for k, v in state.items()}
