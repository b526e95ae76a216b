"""Deprecated: ``ortcapture.compat`` moved to the private module :mod:`ortcapture._ort.compat` in 0.2.0 and goes in 0.3.0.

Import the public names from ``ortcapture`` instead (``ortcapture.__all__``).
"""
import warnings as _warnings

from ortcapture._ort import compat as _target

_warnings.warn("ortcapture.compat is deprecated and will be removed in ortcapture 0.3.0; it moved to the private "
               "module ortcapture._ort.compat (public names: import them from ortcapture)", DeprecationWarning, stacklevel=2)


def __getattr__(name):
    return getattr(_target, name)


def __dir__():
    return dir(_target)
