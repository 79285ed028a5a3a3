"""Dataloader sharding, device placement and exact ``gather_for_metrics`` (see ``hasten.data_loader``)."""

from .dispatch import DataLoaderDispatcher
from .loaders import DataLoaderShard, DataLoaderStateMixin, SkipDataLoader, get_sampler
from .prepare import prepare_data_loader, skip_first_batches
from .metrics import gather_for_metrics
from .order import SeedableRandomSampler
from .samplers import BatchSamplerShard, EpochPlan, IterableDatasetShard, SkipBatchSampler, StepRecord

__all__ = [
    "BatchSamplerShard", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin", "EpochPlan", "IterableDatasetShard",
    "SeedableRandomSampler", "SkipBatchSampler", "SkipDataLoader", "StepRecord", "gather_for_metrics",
    "get_sampler", "prepare_data_loader", "skip_first_batches",
]
