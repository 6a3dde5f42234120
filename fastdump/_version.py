"""The package version, importable by every layer without importing the public API."""

__version__ = "0.1.0"  # keep equal to pyproject.toml
