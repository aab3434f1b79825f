# The one place the version is written: pyproject.toml reads it from here (setuptools'
# dynamic version), the installed metadata carries it, gpumemd reports it and
# gpumem.__version__ is it. A constant rather than a metadata lookup: importlib.metadata
# costs a daemon start (and every client's import) some 20 ms.
__version__ = "0.1.0"
