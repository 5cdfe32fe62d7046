"""The train-digits rank program (see :func:`bitcomm.experiments.digits.run.main`)."""

from bitcomm.comm.launch import finish
from bitcomm.experiments.digits.run import main

main()
finish()
