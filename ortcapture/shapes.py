"""Deprecated: ``ortcapture.shapes`` moved to the private module :mod:`ortcapture._ort.specialize` in 0.2.0 and goes in 0.3.0.

Import the public names from ``ortcapture`` instead (``ortcapture.__all__``).
"""
import warnings as _warnings

from ortcapture._ort import specialize as _target

_warnings.warn("ortcapture.shapes is deprecated and will be removed in ortcapture 0.3.0; it moved to the private "
               "module ortcapture._ort.specialize (public names: import them from ortcapture)", DeprecationWarning, stacklevel=2)


def __getattr__(name):
    return getattr(_target, name)


def __dir__():
    return dir(_target)
