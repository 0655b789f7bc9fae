"""Reducing Keras gradients under Keras' torch backend: the gradients are torch tensors, reduced with
rvod.torch's grouped allreduce (the logic is ``rvod.common.gradients``')."""

import torch

from rvod.common import gradients as _gradients


class TorchGradientReducer(_gradients.GradientReducer):
    def grouped_allreduce(self, grads, compression, op, prescale_factor, postscale_factor, process_set):
        from rvod.torch import grouped_allreduce

        with torch.no_grad():
            return grouped_allreduce(grads, compression=compression, op=op, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, process_set=process_set)
