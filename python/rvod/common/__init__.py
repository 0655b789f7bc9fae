"""Framework-neutral core shared by every shim: basics, process sets, reduce ops, and the collective ops
on DLPack tensors. This package is the only importer of the native module ``rvod._rvod``."""
