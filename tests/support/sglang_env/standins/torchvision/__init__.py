"""Import-only stand-in for ``torchvision`` in the SGLang test environment: see _standin.py."""

from _standin import install

__version__ = "0.0.0+standin"
install(__name__, globals())
