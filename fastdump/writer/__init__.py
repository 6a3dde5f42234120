"""The writer side: ring loop (``loop``), per-channel aggregation (``segments``), segment files
(``h5segment``) and the on-disk names shared with the reader (``format``).

Imported by the writer process: numpy and h5py only, never torch. ``ChannelWriter`` is loaded on
first use so that ``fastdump.writer.format`` stays cheap for the reader.
"""

__all__ = ["ChannelWriter"]


def __getattr__(name):
    if name == "ChannelWriter":
        from .segments import ChannelWriter

        return ChannelWriter
    raise AttributeError(name)
