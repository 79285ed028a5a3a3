"""Dataloader sharding and device placement (``accelerate.data_loader`` names).

The code lives in ``hasten.data``: ``samplers`` (how indices and samples are shared out, and the
record of which ones are padding), ``order`` (``SharedRandomSampler``, ``SeedableRandomSampler``;
seeking to a resume position), ``loaders`` (``DataLoaderShard``), ``prepare`` (``prepare_data_loader``,
``skip_first_batches``), ``position`` (exact resume), ``dispatch`` (``DataLoaderDispatcher``) and ``metrics``
(``gather_for_metrics``).
"""

from .data import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    EpochPlan,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
    StepRecord,
    gather_for_metrics,
    get_sampler,
    prepare_data_loader,
    skip_first_batches,
)

__all__ = [
    "BatchSamplerShard", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin", "EpochPlan", "IterableDatasetShard",
    "SeedableRandomSampler", "SkipBatchSampler", "SkipDataLoader", "StepRecord", "gather_for_metrics",
    "get_sampler", "prepare_data_loader", "skip_first_batches",
]
