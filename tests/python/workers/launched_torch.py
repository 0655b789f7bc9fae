"""torch training in a job a launcher (torchrun) started: DistributedOptimizer on shards against one-process
training on the full batch, after broadcast_parameters from rank 0, and a torch allreduce.

Ends with the usual verdict line (one check per step for each of the two properties, plus two).
"""

import copy

import rvod.torch as hvd
import torch
from _check import check, finish

hvd.init()
R, N = hvd.rank(), hvd.size()
STEPS, ROWS = 4, 3

with check("torch allreduce Sum"):
    got = hvd.allreduce(torch.tensor([R + 1.0, 2.0 * R], dtype=torch.float64), op=hvd.Sum, name="torch.sum")
    assert torch.equal(got, torch.tensor([N * (N + 1) / 2, N * (N - 1)], dtype=torch.float64)), got

torch.manual_seed(100 + R)  # every rank starts from different weights; rank 0's are broadcast
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
reference = copy.deepcopy(model)

with check("broadcast_parameters gave every rank rank 0's weights"):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="initial")
    assert all(torch.equal(gathered[0], row) for row in gathered), "ranks start from different weights"

optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters())
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
data = torch.Generator().manual_seed(7)
for step in range(STEPS):
    x = torch.randn(ROWS * N, 4, generator=data, dtype=torch.float64)
    y = torch.randn(ROWS * N, 1, generator=data, dtype=torch.float64)
    mine = slice(ROWS * R, ROWS * (R + 1))
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    optimizer.step()
    reference_optimizer.zero_grad()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    reference_optimizer.step()
    with check(f"step {step}: the model matches one-process training on the full batch"):
        worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        assert worst < 1e-12, worst
    with check(f"step {step}: every rank holds the same parameters"):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = hvd.allgather(flat.unsqueeze(0), name=f"params.{step}")
        assert all(torch.equal(gathered[0], row) for row in gathered)

hvd.shutdown()
finish(R)
