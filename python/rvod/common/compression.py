"""The compressor interface every shim's ``Compression`` follows, and the compressor that does nothing.

A compressor turns a tensor into what is sent (``compress -> (tensor, ctx)``) and the reduced result back
(``decompress(tensor, ctx) -> tensor``); shims add the casts their framework spells its own way.
"""


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor
