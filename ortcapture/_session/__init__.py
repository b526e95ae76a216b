"""The session layer behind :mod:`ortcapture.session` and :mod:`ortcapture.dropin`: the session and the drop-in.

:mod:`~ortcapture._session.session` is the class (with its methods for capture, buckets and memory in
:mod:`~ortcapture._session.capture`, :mod:`~ortcapture._session.buckets` and :mod:`~ortcapture._session.memory`),
:mod:`~ortcapture._session.setup` its construction-time helpers, :mod:`~ortcapture._session.dropin` the
``AutoCaptureSession`` that ``patch_onnxruntime`` installs.
"""
