"""The transfers behind :mod:`ortcapture.transfer`: checks, sources, copies, a graph's feed targets and host staging.

One concern a module, top to bottom (``.importlinter``'s transfer contract): :mod:`~ortcapture._transfer.staging`
(a graph's own host buffers) and :mod:`~ortcapture._transfer.targets` (a graph's fixed inputs as the replay path
copies feeds into them) over :mod:`~ortcapture._transfer.copy` (``update_inplace``, ``copy``, ``to_numpy`` and their
backends) over :mod:`~ortcapture._transfer.sources` (DLPack producers, numpy arrays) and
:mod:`~ortcapture._transfer.host_copy` (the staging threads) over :mod:`~ortcapture._transfer.check` (what every
transfer checks before any native call). :mod:`ortcapture.transfer` re-exports the public names.
"""
