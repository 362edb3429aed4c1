"""The package version, in a module of its own so the engine can read it without importing the front ends."""

__version__ = "0.1.0"
