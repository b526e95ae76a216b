"""The feeds of an ``InferenceSession``'s uncaptured runs, made safe before ORT sees them.

A method of :class:`ortcapture._session.session.InferenceSession` (assigned in its class body), as in
:mod:`ortcapture._session.memory`: what the session knows — its capture device, the inputs ORT reads on the host,
its inputs' element types — handed to :func:`ortcapture._transfer.check.check_plain_feeds`, the one check.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ortcapture._buckets.feeds import from_list
from ortcapture._buckets.feeds import specs as input_specs
from ortcapture._ort import compat
from ortcapture._ort.specialize import host_read_inputs
from ortcapture._transfer.check import check_plain_feeds


def oc_plain_feeds(self, input_feed: Any) -> Any:
    """``input_feed`` as this session's uncaptured ``run`` / ``run_async`` hands it to ORT
    (:func:`~ortcapture._transfer.check.check_plain_feeds`: ``None`` feeds left out, non-native byte order made
    native, on a capturing WebGPU session feeds over 2 GiB and int64 values outside int32 refused). On a capturing
    WebGPU session a list feed is first converted as ORT converts it (to the input's element type), so its values are
    checked too; the inputs ORT reads on the host are left out of the int64 check. Never changes the caller's dict.

    Raises:
        TransferError: a WebGPU refusal, naming the input.
    """
    if not isinstance(input_feed, Mapping):
        return input_feed
    st = self._oc_state
    device = st.device
    host_read: frozenset = frozenset()
    if device is not None and device.device_type == "webgpu":
        c_session = id(compat.c_session(self))  # its id only: holding it would keep a replaced C session alive
        known = st.plain_inputs
        if known is None or known[0] != c_session:  # per C session (set_providers, compact rebuild it)
            known = st.plain_inputs = (c_session, host_read_inputs(self), input_specs(self))
        _, host_read, specs = known
        if any(type(v) is list for v in input_feed.values()):
            converted = {}
            for name, v in input_feed.items():
                spec = specs.get(name)
                arr = from_list(spec, v) if type(v) is list and spec is not None else None
                converted[name] = v if arr is None else arr
            input_feed = converted
        # a feed of another element type than its input's is ORT's own type error, not a value to check: an int64
        # feed for a float input must not be told to keep within int32
        host_read = host_read | {n for n, v in input_feed.items() if isinstance(v, np.ndarray) and n in specs
                                 and specs[n].dtype is not None and v.dtype.newbyteorder("=") != specs[n].dtype}
    return check_plain_feeds(input_feed, device, host_read)
