"""The exception the seed's API raises for arguments of the wrong type.

HyperParallel raises ``ValueError`` for every bad argument; Python convention (and torch) raise
``TypeError`` for a wrong type. :class:`ArgumentTypeError` is both, so code written against either
(``except ValueError`` or ``except TypeError``) keeps catching it.
"""

from __future__ import annotations

from hp_lightning.core.checks import ArgumentTypeError  # defined with the option checks that raise it

__all__ = ["ArgumentTypeError"]
