"""Code both sides import: the wire protocol, the fd channel, runtime paths, drivers."""

from gpumem_shared._version import __version__

__all__ = ["__version__"]
