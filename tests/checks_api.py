"""Checks of the public API that scripts use on every rank (see distributed.py): copying a tensor
that one process owns, the run-on-some-processes decorators, RNG synchronisation from the top-level
name, re-creating the state objects, ``no_sync``, regional compilation and torch.compile with bf16 under DDP."""

import torch
from torch import nn

import hasten
from hasten import Accelerator
from hasten.state import AcceleratorState, PartialState
from hasten.utils.operations import copy_tensor_to_devices, gather


def check_copy_tensor_to_devices():
    acc = Accelerator()
    owner = acc.num_processes - 1
    mine = torch.arange(6, dtype=torch.int32, device=acc.device).reshape(2, 3) * 10 if acc.process_index == owner else None
    got = copy_tensor_to_devices(mine)
    assert got.dtype == torch.int32 and got.tolist() == [[0, 10, 20], [30, 40, 50]], got
    # A float tensor that requires grad (e.g. a model output) is sent without being written to.
    source = torch.linspace(0, 1, 4, device=acc.device, requires_grad=True) if acc.is_main_process else None
    copied = copy_tensor_to_devices(source)
    assert not copied.requires_grad and copied.tolist() == torch.linspace(0, 1, 4).tolist()
    errors = []
    for give in (lambda: None, lambda: torch.ones(2, device=acc.device)):  # nobody owns it / everybody does
        try:
            copy_tensor_to_devices(give())
        except ValueError as e:
            errors.append(str(e))
    return errors


def check_decorators():
    acc = Accelerator()
    ran = []
    acc.on_main_process(lambda: ran.append("main"))()
    acc.on_main_process()(lambda: ran.append("main()"))()
    acc.on_local_main_process()(lambda: ran.append("local"))()
    acc.on_last_process(lambda: ran.append("last"))()
    acc.on_process(process_index=1)(lambda: ran.append("p1"))()
    acc.on_local_process(lambda: ran.append("l0"), local_process_index=0)()
    state = PartialState()

    @state.on_process(process_index=0)
    def answer():
        return 42

    return ran, answer()


def check_rng_states_from_top_level_name():
    acc = Accelerator()
    torch.manual_seed(100 + acc.process_index)  # different on purpose
    generator = torch.Generator().manual_seed(7 + acc.process_index)
    hasten.synchronize_rng_states(["torch", "generator"], generator=generator)
    draws = torch.stack([torch.rand(3), torch.rand(3, generator=generator)])
    everyone = gather(draws[None].to(acc.device))  # the CPU generators drew; collectives run on the device
    assert all(torch.equal(everyone[0], other) for other in everyone), everyone
    return draws.tolist()


def check_state_objects_can_be_created_again():
    acc = Accelerator()
    again = AcceleratorState()
    partial = PartialState()
    assert again.distributed_type == acc.distributed_type and again.mixed_precision == "no"
    return [again.num_processes, again.process_index, partial.process_index, str(again.distributed_type)]


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def check_no_sync_keeps_gradients_local():
    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(nn.Linear(4, 1))
    x = torch.full((2, 4), float(acc.process_index + 1), device=acc.device)
    with acc.no_sync(model):
        model(x).sum().backward()
    local = _grads(model).clone()
    everyone = gather(local[None])
    differ = not torch.equal(everyone[0], everyone[-1])
    model.zero_grad()
    model(x).sum().backward()  # outside no_sync: averaged over processes
    synced = gather(_grads(model)[None])
    assert torch.allclose(synced[0], synced[-1])
    expected = everyone.mean(0)
    assert torch.allclose(_grads(model), expected), (_grads(model), expected)
    return differ


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def check_regional_compilation_under_ddp():
    """Compiled blocks inside DDP: gradients are still averaged (DDP's hooks stay on the call path)."""
    acc = Accelerator(dynamo_plugin=hasten.utils.TorchDynamoPlugin(backend="eager",
                                                                            use_regional_compilation=True))
    torch.manual_seed(0)
    reference = Stack()
    model = Stack()
    model.load_state_dict(reference.state_dict())
    reference.to(acc.device)
    model = acc.prepare(model)
    inner = acc.unwrap_model(model)
    assert all(block._compiled_call_impl is not None for block in inner.blocks)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * acc.num_processes, 6, generator=g).to(acc.device)
    mine = x[acc.process_index * 2:(acc.process_index + 1) * 2]
    model(mine).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    for p, q in zip(inner.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    return True


def check_compile_with_bf16_under_ddp():
    """torch.compile around DDP with bf16: the autocast is entered outside the compiled graph and the
    gradients are still averaged, equal to one process's autocast run on the whole batch."""
    acc = Accelerator(mixed_precision="bf16", dynamo_backend="aot_eager")
    torch.manual_seed(0)
    reference = Stack().to(acc.device)
    model = Stack().to(acc.device)
    model.load_state_dict(reference.state_dict())
    model = acc.prepare(model)
    assert type(model._orig_mod).__name__ == "DistributedDataParallel"  # compiled around DDP
    inner = acc.unwrap_model(model, keep_torch_compile=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * acc.num_processes, 6, generator=g).to(acc.device)
    out = model(x[acc.process_index * 2:(acc.process_index + 1) * 2])
    assert out.dtype == torch.float32
    acc.backward(out.pow(2).mean())
    with torch.autocast(acc.device.type, dtype=torch.bfloat16):
        expected = reference(x)
    assert expected.dtype == torch.bfloat16
    expected.float().pow(2).mean().backward()
    for p, q in zip(inner.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)
    return True


def check_save_and_load_state_with_a_folder_per_process():
    """Each process passes its own temporary folder (Accelerate's test scripts do): the main process's is used."""
    import tempfile

    acc = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with tempfile.TemporaryDirectory() as own:
        saved_to = acc.save_state(own)
        acc.wait_for_everyone()
        before = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        loaded_from = acc.load_state(own)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        acc.wait_for_everyone()  # rank 0's folder must outlive the others' loads
        names = gather_object_names(saved_to, loaded_from)
    return names


def gather_object_names(saved_to, loaded_from):
    from hasten.utils.operations import gather_object

    everyone = gather_object([(saved_to, loaded_from)])
    return [saved == everyone[0][0] and loaded == everyone[0][0] for saved, loaded in everyone]


class Indexed(torch.utils.data.Dataset):
    """Dict samples, like a tokenised dataset; 22 items do not split evenly into 2 x batches of 4."""

    def __len__(self):
        return 22

    def __getitem__(self, i):
        if isinstance(i, list):  # a BatchSampler given as sampler= hands over a batch of indices
            return [self[j] for j in i]
        return {"index": i, "label": i % 2, "noise": torch.rand(1).item()}


def check_every_loader_shape_yields_each_sample_once():
    """Plain, shuffled, batch_sampler=, and a BatchSampler passed as sampler= (batch_size=None), with a
    worker process: gather_for_metrics returns each sample exactly once."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler
    from torch.utils.data.dataloader import default_collate

    acc = Accelerator()
    data = Indexed()
    shapes = {
        "plain": DataLoader(data, batch_size=4, num_workers=1),
        "shuffled": DataLoader(data, batch_size=4, shuffle=True, num_workers=1),
        "batch_sampler": DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, False), num_workers=1),
        "sampler_is_batch_sampler": DataLoader(data, sampler=BatchSampler(RandomSampler(data), 4, False),
                                               batch_size=None, collate_fn=default_collate, num_workers=1),
    }
    seen = {}
    for name, loader in shapes.items():
        prepared = acc.prepare(loader)
        got = []
        for batch in prepared:
            index, label = acc.gather_for_metrics((batch["index"], batch["label"]))
            assert torch.equal(label, index % 2)
            got.extend(index.tolist())
        seen[name] = sorted(got)
    return seen
