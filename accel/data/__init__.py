"""Data movement for the compiler path: device loading, sequence packing, static-shape bucketing."""
from accel.data.bucketing import BucketBatchSampler, BucketingCollate, BucketingLoader
from accel.data.device_loader import MpDeviceLoader
from accel.data.packing import PackedCollator, PackedDataset, block_diagonal_mask, pack_lengths
from accel.data.padding_stats import PaddingStats
from accel.data.resumable import ResumableLoader

__all__ = [
    "BucketBatchSampler",
    "BucketingCollate",
    "BucketingLoader",
    "MpDeviceLoader",
    "PackedCollator",
    "PackedDataset",
    "PaddingStats",
    "ResumableLoader",
    "block_diagonal_mask",
    "pack_lengths",
]
