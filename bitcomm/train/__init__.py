"""Training with compressed communication: optimizers over bitcomm's collectives.

* :class:`~bitcomm.train.feedback.ErrorFeedback`: residuals re-added after compression.
* :class:`~bitcomm.train.signum.MajoritySignSGD`: Signum with a majority vote (ring or
  all-to-all).
* :class:`~bitcomm.train.onebit_adam.OneBitAdam`: DeepSpeed's 1-bit Adam.
* :class:`~bitcomm.train.qsgd_sgd.QSGDSGD`: SGD on QSGD-quantised gradient averages.
* :class:`~bitcomm.train.rgc.RGC`: RedSync's residual gradient compression (top-k SGD).
* :class:`~bitcomm.train.oktopk_sgd.OkTopkSGD`: Ok-Topk's sparse SGD over its O(k) sparse
  allreduce.
* :class:`~bitcomm.train.rgc.SIDCoSGD`: SIDCo's error-compensated SGD with statistical
  thresholds.
* :class:`~bitcomm.train.sparcml_sgd.SparCMLSGD`: SparCML's bucketed top-k SGD over a sparse
  allreduce.
* :class:`~bitcomm.train.scaler.GradScaler`: ``torch.amp.GradScaler`` agreeing on overflows.
* :mod:`~bitcomm.train.hooks`: DDP communication hooks (sign majority, 1-bit, qsgd, top-k).

Each is a ``torch.optim.Optimizer`` taking a :class:`~bitcomm.comm.base.Comm`; every rank builds
it over the same parameters in the same order, calls ``backward`` on its own batch and then
``step()``, which exchanges what the method sends and leaves the parameters identical on every
rank. This layer imports the collectives, the transports and the codecs, never the reverse.
"""

from bitcomm.train.feedback import ErrorFeedback
from bitcomm.train.oktopk_sgd import OkTopkSGD
from bitcomm.train.onebit_adam import OneBitAdam
from bitcomm.train.qsgd_sgd import QSGDSGD
from bitcomm.train.rgc import RGC, SIDCoSGD
from bitcomm.train.scaler import GradScaler
from bitcomm.train.signum import MajoritySignSGD
from bitcomm.train.sparcml_sgd import SparCMLSGD

__all__ = ["ErrorFeedback", "GradScaler", "MajoritySignSGD", "OkTopkSGD", "OneBitAdam",
           "QSGDSGD", "RGC", "SIDCoSGD", "SparCMLSGD"]
