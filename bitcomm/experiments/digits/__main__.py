"""The train-digits rank program (see :func:`bitcomm.experiments.digits.run.main`)."""

from bitcomm.experiments.digits.run import main

main()
