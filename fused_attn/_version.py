"""The package version: the one source (pyproject.toml reads it through setuptools' dynamic `attr`)."""

__version__ = "0.1.0"
