"""Emulated networks: topologies (YAML), namespaces shaped with tc, MPI jobs across them.

Sits above the collectives; nothing below imports it. Needs root and iproute2 to build
networks; :mod:`~bitcomm.netem.topology` alone needs neither.
"""
