"""Experiment harnesses built on bitcomm's layers (nothing in the library imports them).

* :mod:`~bitcomm.experiments.digits`: compressed optimizers training an MLP on real data.

The network experiments live in :mod:`bitcomm.netem`, with the emulator they need.
"""
