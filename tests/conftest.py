import pytest
import torch

from bitcomm.codecs import _frame

# Awkward sizes from the issue: 0, 1, 7, 8, 9 and 2**k +- 1.
AWKWARD = [0, 1, 7, 8, 9, 15, 16, 17, 63, 65, 255, 257, 1023, 1025, 4095, 4097]

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")


@pytest.fixture(params=["numpy", "torch"])
def path(request):
    """Run a test on the CPU fast path and on the torch-only path that CUDA tensors take."""
    _frame.FORCE_TORCH = request.param == "torch"
    yield request.param
    _frame.FORCE_TORCH = False


def hexbytes(t: torch.Tensor) -> str:
    return " ".join(f"{b:02x}" for b in t.tolist())


def unhex(s: str) -> list[int]:
    return [int(b, 16) for b in s.replace("|", " ").split()]
