"""Benchmarks: functions that measure and return rows; the CLI prints and saves them."""

from __future__ import annotations

__all__ = ["heading"]


def heading(config: dict, command: str) -> list[str]:
    """Return the lines that head a saved Markdown table: its date, machine and command.

    ``config``: what the command saved with its rows (``time`` and the machine's facts, as the
    CLI gathers them; a GPU's name, codec path and triton version when it ran on one; the
    CPUs it was confined to, ``affinity``, when they were fewer than the machine's).
    """
    machine = f"{config.get('machine', '?')}, {config.get('cpus', '?')} CPUs, torch " \
        f"{config.get('torch', '?')} ({config.get('threads', '?')} threads)"
    if "affinity" in config:
        machine += f", run on CPUs {config['affinity']} alone"
    if "gpu" in config:
        machine = f"{config['gpu'].replace('_', ' ')} ({config.get('path', '?')} path" + \
            (f", triton {config['triton']}" if "triton" in config else "") + f"); {machine}"
    return [f"- Date: {str(config.get('time', '?'))[:10]}", f"- Machine: {machine}",
            f"- Command: `{command}`", ""]
