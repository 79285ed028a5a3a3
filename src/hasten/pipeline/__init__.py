"""Pipeline parallelism behind the four-line loop (``ParallelismConfig(pp_size=...)``), on torch.distributed.pipelining.

``split`` cuts a model into stages, ``schedule`` builds torch's schedule and places stages on
processes, ``model`` is the prepared model whose forward runs a schedule step, ``tracking`` tells the
hang and failure reports which stage, step and action (forward/backward of microbatch k) a process is in.
The strategy that ties them to the Accelerator is ``hasten.strategies.pipeline``. See docs/pipeline.md.
"""

from .model import PipelinedModel, PipelineOutput, pipeline_loss

__all__ = ["PipelineOutput", "PipelinedModel", "pipeline_loss"]
