"""The writer side: ring loop (``loop``), per-channel aggregation (``channel_writer``) and the HDF5
segment files (``segment_file``). The on-disk names it shares with the reader live in
``fastdump.format``.

Imported by the writer process: numpy and h5py only, never torch. ``ChannelWriter`` is loaded on
first use so that importing ``fastdump.writer`` stays cheap.
"""

__all__ = ["ChannelWriter"]


def __getattr__(name):
    if name == "ChannelWriter":
        from .channel_writer import ChannelWriter

        return ChannelWriter
    raise AttributeError(name)
