"""The package version, in a module of its own so that any layer can name it without importing
the ``inferd`` facade (which sits above them all)."""

__version__ = "0.1.0"
