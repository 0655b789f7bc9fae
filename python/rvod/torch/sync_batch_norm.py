"""Batch normalization over the batches of every rank together.

In training, each rank computes its per-channel count, mean and sum of squared deviations from that
mean; the ranks allgather those (one small collective) and combine them exactly (Chan's parallel
variance), so the result equals ``nn.BatchNorm`` on the concatenated batch. Backward allreduces the two
per-channel sums the input gradient needs; the weight and bias gradients stay this rank's share (their
sum over ranks is the concatenated batch's gradient, and DistributedOptimizer reduces them like any other
gradient). Collectives are named by channel count, so layers of the same width share response-cache
entries.
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from rvod.common.process_sets import global_process_set
from rvod.common.reduce_ops import Sum
from rvod.torch.mpi_ops import allgather, allreduce


def _per_channel(vector, dims):
    """A per-channel vector shaped to broadcast against an (N, C, ...) tensor with ``dims`` dimensions."""
    return vector.reshape((1, -1) + (1,) * (dims - 2))


def _compute_dtype(dtype):
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, process_set):
        channels, dims = input.shape[1], input.dim()
        reduce_dims = [0] + list(range(2, dims))
        x = input.detach().to(_compute_dtype(input.dtype))
        count = input.numel() // channels if channels else 0
        local_mean = x.mean(dim=reduce_dims) if count else x.new_zeros(channels)
        local_m2 = ((x - _per_channel(local_mean, dims)) ** 2).sum(dim=reduce_dims)
        row = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device), local_mean.double(), local_m2.double()])
        stats = allgather(row.unsqueeze(0), name=f"sync_batch_norm.stats.{channels}", process_set=process_set)
        counts, means, m2s = stats[:, :1], stats[:, 1:1 + channels], stats[:, 1 + channels:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                             f"{list(input.shape)} here and {int(total)} values per channel over all ranks")
        mean = (counts * means).sum(dim=0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(dim=0)
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((m2 / (total - 1)).to(running_var.dtype), alpha=momentum)

        invstd = invstd.to(x.dtype)
        normalized = (x - _per_channel(mean.to(x.dtype), dims)) * _per_channel(invstd, dims)
        output = normalized
        if weight is not None:
            output = output * _per_channel(weight.detach().to(x.dtype), dims)
        if bias is not None:
            output = output + _per_channel(bias.detach().to(x.dtype), dims)
        ctx.save_for_backward(normalized, invstd, weight)
        ctx.total = total
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.input_dtype = input.dtype
        ctx.process_set = process_set
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        normalized, invstd, weight = ctx.saved_tensors
        channels, dims = normalized.shape[1], normalized.dim()
        reduce_dims = [0] + list(range(2, dims))
        dy = grad_output.to(normalized.dtype)
        local_sums = torch.stack([dy.sum(dim=reduce_dims), (dy * normalized).sum(dim=reduce_dims)])
        sum_dy, sum_dy_xhat = allreduce(local_sums, op=Sum, name=f"sync_batch_norm.grads.{channels}",
                                        process_set=ctx.process_set)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else invstd * weight.detach().to(invstd.dtype)
            grad_input = (dy - _per_channel(sum_dy / ctx.total, dims)
                          - normalized * _per_channel(sum_dy_xhat / ctx.total, dims)) * _per_channel(scale, dims)
            grad_input = grad_input.to(ctx.input_dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = local_sums[1].to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = local_sums[0].to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """``nn.BatchNorm{1,2,3}d`` whose training statistics cover the batches of every rank.

    Arguments are ``nn.BatchNorm``'s (plus rvod's ``process_set``); inputs are (N, C, ...). In evaluation
    mode, and when the process set has one rank, it is exactly ``nn.BatchNorm``.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None
        if not self.training or self.process_set.size() == 1:
            batch_stats = self.training or (self.running_mean is None and self.running_var is None)
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_stats, momentum,
                                self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var, self.eps,
                                            momentum, self.process_set)
