"""Bit-level codecs: tensor <-> packed bytes, pure ``encode``/``decode`` pairs.

One module per codec, each documenting its wire format with a worked example:

* :mod:`~bitcomm.codecs.bits`: unsigned integers in exactly w bits (bit planes), 1 <= w <= 16.
* :mod:`~bitcomm.codecs.sign`: 1 bit per element, MSB-first, bit 1 = ``x >= 0``; scaled frames.
* :mod:`~bitcomm.codecs.counts`: counts in [0, m] in ceil(log2(m+1)) bits, or radix-packed.
* :mod:`~bitcomm.codecs.qsgd`: stochastic bucketed quantisation at 2, 4 or 8 bits.
* :mod:`~bitcomm.codecs.redsync`: RedSync's sign-uniform mean of k selected elements.
* :mod:`~bitcomm.codecs.sparse`: self-describing (index, value) frames.
* :mod:`~bitcomm.codecs.stream`: SparCML's sparse streams, switching to dense when smaller.
* :mod:`~bitcomm.codecs.select`: top-k, trimmed top-k and threshold binary search selectors.

Every ``decode`` takes its frame as a 1-D uint8 tensor on any device, a 1-D uint8 numpy array
or bytes (``bytes``, ``bytearray``, ``memoryview``), and returns ``(result, bytes_consumed)``
(the convention of Python's ``codecs`` module), so frames can be read back to back from one
buffer. :func:`backend` says which implementation a tensor gets (numpy on the CPU, Triton
kernels on CUDA, torch ops otherwise); all three write the same bytes.

Decoders allocate only what their frame can justify: every ``decode`` takes an optional ``n``,
the length the caller expects (a header that says otherwise is a ``ValueError``), and without
one refuses a header length above ``max(MIN_DECODE_LIMIT, MAX_ELEMENTS_PER_BYTE * frame
bytes)``, which only outputs that no payload backs can reach.
"""

from bitcomm.codecs import bits, counts, qsgd, redsync, select, sign, sparse, stream
from bitcomm.codecs._frame import MAX_ELEMENTS_PER_BYTE, MIN_DECODE_LIMIT, backend

__all__ = ["backend", "MAX_ELEMENTS_PER_BYTE", "MIN_DECODE_LIMIT", "bits", "counts", "qsgd",
           "redsync", "select", "sign", "sparse", "stream"]
