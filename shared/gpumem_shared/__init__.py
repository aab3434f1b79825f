"""Code both sides import: the wire protocol, the fd channel, runtime paths, drivers."""

__version__ = "0.1.0"
