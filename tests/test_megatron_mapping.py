"""``MegatronLMPlugin`` mapped onto hasten's own layout (``ParallelismConfig``), and the Megatron-only parts
refused in one line naming the native option. Single process: an Accelerator cannot reach pp_size=2 here, so
the mapping is tested directly, and through ``Accelerator(megatron_lm_plugin=...)`` where the error must come
before any process group exists."""

import re
import warnings

import pytest


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    import hasten.utils.megatron_lm as megatron

    monkeypatch.setattr(megatron, "_warned", False)
    for key in ("MEGATRON_LM_TP_DEGREE", "MEGATRON_LM_PP_DEGREE", "MEGATRON_LM_NUM_MICRO_BATCHES",
                "PARALLELISM_CONFIG_TP_SIZE", "PARALLELISM_CONFIG_PP_SIZE"):
        monkeypatch.delenv(key, raising=False)


def test_layout_fields_map_onto_parallelism_config():
    from hasten.utils import MegatronLMPlugin, ParallelismConfig
    from hasten.utils.megatron_lm import parallelism_from_megatron

    with pytest.warns(UserWarning) as caught:
        config = parallelism_from_megatron(MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=4))
    assert isinstance(config, ParallelismConfig)
    assert (config.tp_size, config.pp_size, config.pp_microbatches, config.total_size) == (2, 2, 4, 4)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert messages[0].startswith("MegatronLMPlugin mapped to ParallelismConfig(tp_size=2, pp_size=2, "
                                  "pp_microbatches=4"), messages
    assert "Megatron's own train step is not used" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        parallelism_from_megatron(MegatronLMPlugin(tp_degree=2))
    assert parallelism_from_megatron(None, config) is config


def test_context_parallel_size_maps_onto_cp_size():
    from hasten.utils import MegatronLMPlugin
    from hasten.utils.megatron_lm import parallelism_from_megatron

    with pytest.warns(UserWarning, match=r"tp_size=2, pp_size=1, cp_size=2, "):
        config = parallelism_from_megatron(MegatronLMPlugin(tp_degree=2, context_parallel_size=2,
                                                            expert_model_parallel_size=1))
    assert (config.tp_size, config.cp_size, config.total_size) == (2, 2, 4)


def test_environment_fills_unset_fields(monkeypatch):
    from hasten.utils import MegatronLMPlugin

    monkeypatch.setenv("MEGATRON_LM_TP_DEGREE", "4")
    monkeypatch.setenv("MEGATRON_LM_PP_DEGREE", "2")
    plugin = MegatronLMPlugin()
    assert (plugin.tp_degree, plugin.pp_degree, plugin.num_micro_batches, plugin.sequence_parallelism) == (
        4, 2, 1, False)


def test_fields_that_are_not_applied_are_named_in_the_warning():
    from hasten.utils import MegatronLMPlugin
    from hasten.utils.megatron_lm import parallelism_from_megatron

    with pytest.warns(UserWarning, match=r"not applied: .*train_iters.*lr_decay_style"):
        parallelism_from_megatron(MegatronLMPlugin(tp_degree=2, train_iters=100, lr_decay_style="cosine"))


@pytest.mark.parametrize("kwargs, named", [
    (dict(sequence_parallelism=True), "ParallelismConfig(cp_size=...)"),
    (dict(megatron_dataset_flag=True), "torch DataLoader"),
    (dict(custom_train_step_class=object), "accelerator.backward(loss)"),
    (dict(custom_loss_function=len), "compute the loss in your loop"),
    (dict(use_distributed_optimizer=True), "dp_shard_size"),
    (dict(num_layers_per_virtual_pipeline_stage=2), "pp_schedule='Interleaved1F1B'"),
    (dict(other_megatron_args={"foo": 1}), "ParallelismConfig"),
    (dict(num_micro_batches=4), "gradient_accumulation_steps=4"),
    (dict(expert_model_parallel_size=2), "expert parallelism is not available"),
    (dict(recompute_granularity="selective"), "ActivationCheckpointingKwargs"),
    (dict(use_custom_fsdp=True), "fsdp_plugin"),
])
def test_megatron_only_parts_are_refused_in_one_line(kwargs, named):
    from hasten.utils import MegatronLMPlugin
    from hasten.utils.megatron_lm import parallelism_from_megatron

    with pytest.raises(ValueError) as caught:
        parallelism_from_megatron(MegatronLMPlugin(**kwargs))
    text = str(caught.value)
    assert named in text and "\n" not in text, text
    assert text.startswith("MegatronLMPlugin(" + next(iter(kwargs)) + "="), text


def test_sequence_parallelism_false_is_fine():
    from hasten.utils import MegatronLMPlugin
    from hasten.utils.megatron_lm import parallelism_from_megatron

    with pytest.warns(UserWarning, match="mapped to"):
        assert parallelism_from_megatron(MegatronLMPlugin(tp_degree=2, sequence_parallelism=False)).tp_size == 2


def test_refusals_come_from_the_accelerator_before_any_process_group(fresh_state):
    import torch.distributed as dist

    from hasten import Accelerator
    from hasten.utils import MegatronLMPlugin, ParallelismConfig

    with pytest.raises(ValueError, match="not both"):
        Accelerator(cpu=True, megatron_lm_plugin=MegatronLMPlugin(tp_degree=2),
                    parallelism_config=ParallelismConfig(tp_size=2))
    with pytest.raises(ValueError, match=re.escape("MegatronLMPlugin(megatron_dataset_flag=True)")):
        Accelerator(cpu=True, megatron_lm_plugin=MegatronLMPlugin(megatron_dataset_flag=True))
    with pytest.raises(TypeError, match="megatron_lm_plugin must be a hasten.utils.MegatronLMPlugin"):
        Accelerator(cpu=True, megatron_lm_plugin=object())
    # The mapped layout is checked like any ParallelismConfig: tp 2 x pp 2 cannot run on this one process.
    with pytest.warns(UserWarning, match="mapped to"), pytest.raises(ValueError, match="= 4 processes, but this job"):
        Accelerator(cpu=True, megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2))
    assert not (dist.is_available() and dist.is_initialized())


def test_a_plugin_of_size_one_trains_on_one_process(fresh_state):
    from hasten import Accelerator
    from hasten.utils import MegatronLMPlugin

    with pytest.warns(UserWarning, match=r"mapped to ParallelismConfig\(tp_size=1, pp_size=1"):
        acc = Accelerator(cpu=True, megatron_lm_plugin=MegatronLMPlugin())
    assert acc.num_processes == 1


def test_dummy_scheduler_and_loader_name_the_native_option():
    from hasten.utils import MegatronLMDummyDataLoader, MegatronLMDummyScheduler
    from hasten.utils.compat import REFUSED

    assert "torch LR scheduler" in REFUSED["MegatronLMDummyScheduler"]
    assert "torch DataLoader" in REFUSED["MegatronLMDummyDataLoader"]
    with pytest.raises(NotImplementedError, match="torch LR scheduler"):
        MegatronLMDummyScheduler()
    with pytest.raises(NotImplementedError, match="torch DataLoader"):
        MegatronLMDummyDataLoader()
