"""Exception types.

Every ortcapture error derives from :class:`CaptureError`, a subclass of ``ValueError`` — the type ORT's own
Python layer raises for its WebGPU graph-capture guards (ORT PR #32074) — so ``except ValueError`` clauses
written against ORT keep working.
"""


class CaptureError(ValueError):
    """Base class: a graph-capture operation would be unsafe or cannot be done."""


class CaptureUnsupportedError(CaptureError):
    """The session, execution provider, or installed ORT version cannot capture (or lacks a needed feature)."""


class BindingError(CaptureError):
    """An IOBinding or buffer does not match what a captured graph pinned (rebind, clear, other buffer)."""


class TransferError(CaptureError):
    """An in-place update or copy was refused before reaching native code (shape, dtype, device, aliasing)."""


class GraphReleasedError(CaptureError):
    """A ``gpu_graph_id`` was released and cannot be replayed again (CUDA/TensorRT release is a no-op in ORT)."""


class StaleOutputError(CaptureError):
    """A ``copy_outputs=False`` output was read after a later replay overwrote its buffer."""


class PatchError(CaptureError):
    """Applying, checking or reverting a source patch failed (used by ``ortcapture patch``)."""


class CaptureAbortedError(CaptureError, RuntimeError):
    """A capturing ``run_with_iobinding`` failed inside ORT (e.g. ``RunOptions.terminate``). Also a ``RuntimeError``,
    the type ORT raises for a failed run, so ``except RuntimeError`` written against ORT keeps working."""


class PointerLifetimeWarning(UserWarning):
    """A raw device pointer was bound under capture without ``owner=``: the memory must outlive the captured graph
    (ortcapture cannot keep it alive, and a replay after it is freed reads or writes freed memory)."""


class EPAccuracyWarning(UserWarning):
    """The capturing EP's own (uncaptured) results differ from ORT's CPU EP beyond tolerance on the same inputs.

    Not a capture fault: verification judges a captured graph against the same EP's uncaptured run, because an EP
    may compute differently from the CPU EP without any capture (measured on WebGPU: a recurrent model's state
    differed by 0.43 after one step, its captured replay equal to the uncaptured WebGPU run). Warned once per
    session at ``verify="full"``; ``ortcapture doctor`` reports it as "EP accuracy" and names the first node that
    differs."""
