"""Fork safety (2 ranks): a training loop whose torch DataLoader forks 2 workers every epoch, 4 epochs (the `fork`
start method). The workers inherit the initialized rvod; the parent's job must not notice them, and an rvod
collective called inside a worker raises a clear error instead of touching the parent's connections.
"""

import multiprocessing

import torch
import rvod.torch as hvd
from _check import check, finish

hvd.init()
R, N = hvd.rank(), hvd.size()


class Numbers(torch.utils.data.Dataset):
    """y = 3x + 1 on this rank's share of the data; item 0 also tries a collective inside the worker."""

    def __len__(self):
        return 256

    def __getitem__(self, index):
        x = torch.tensor([float(index * N + R) / 256.0 - 1.0])
        probe = torch.tensor(0.0)
        if index == 0:
            try:
                hvd.allreduce(torch.ones(1), name="from.worker")
            except RuntimeError as error:
                forked = "forked" in str(error) and f"from rank {R}" in str(error)
                probe = torch.tensor(1.0 if forked else -1.0)
            else:
                probe = torch.tensor(-2.0)
        return x, 3 * x + 1, probe


loader = torch.utils.data.DataLoader(Numbers(), batch_size=8, num_workers=2,
                                     multiprocessing_context=multiprocessing.get_context("fork"))
model = torch.nn.Linear(1, 1)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                     named_parameters=model.named_parameters())
probes = []
for epoch in range(4):
    for x, y, probe in loader:
        probes.extend(probe.tolist())
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

with check("a collective in a forked DataLoader worker raised a clear error naming the fork"):
    assert probes.count(1.0) == 4 and probes.count(-1.0) == 0 and probes.count(-2.0) == 0, probes[:16]
with check("training went on in the parent: the model learned y = 3x + 1"):
    weight, bias = model.weight.item(), model.bias.item()
    assert abs(weight - 3) < 0.05 and abs(bias - 1) < 0.05, (weight, bias)
with check("both ranks hold the same parameters"):
    gathered = hvd.allgather(torch.cat([model.weight.detach().reshape(-1), model.bias.detach()]).reshape(1, 2),
                             name="params")
    assert torch.equal(gathered[0], gathered[1]), gathered
with check("collectives still work after the workers exited"):
    assert hvd.allreduce(torch.tensor([R + 1.0]), op=hvd.Sum, name="after").item() == N * (N + 1) / 2
with check("a process forked outside torch refuses collectives too, and its exit leaves the job alone"):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def child():
        try:
            hvd.allreduce(torch.ones(1), name="from.child")
            queue.put("no error")
        except RuntimeError as error:
            queue.put(str(error))
        hvd.shutdown()  # must not stop the parent's engine

    process = context.Process(target=child)
    process.start()
    message = queue.get(timeout=20)
    process.join(20)
    assert "forked" in message and "spawn" in message, message
    assert process.exitcode == 0, process.exitcode
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after.child").item() == N

hvd.shutdown()
finish(R)
