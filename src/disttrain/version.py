"""The one place the version is written (the package and the checkpoint manifest read it)."""

__version__ = "0.2.0"
