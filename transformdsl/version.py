"""The package version (what ``transformdsl --version`` prints and saves record)."""

__version__ = "0.1.0"
