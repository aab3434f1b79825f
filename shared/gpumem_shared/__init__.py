"""Code both sides import: the wire protocol, the fd channel, runtime paths, drivers."""

from importlib.metadata import version

# pyproject.toml is the one place the version is written; an installed copy (editable
# included) carries it in its metadata. The daemon reports this, gpumem re-exports it.
__version__ = version("gpumemd")
