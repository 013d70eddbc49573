"""The runtime: executes the installed plan's schedules (install -> one executor per module ->
input distribution, kernels, output distribution and their collectives)."""

from lightning_sparselift.runtime.install import InstalledExecutor, install

__all__ = ["InstalledExecutor", "install"]
