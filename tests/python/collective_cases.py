"""The collective cases every framework runs, one id per case (``allreduce-sum-float32-inplace-2ranks``).

One behaviour (allreduce, grouped allreduce, allgather, ...) has one test body in
workers/collective_cases.py, written against a small adapter per framework; this table says which
dtypes, variants and rank counts each framework runs it with. A case a framework cannot express is not
generated for it (the reasons are next to each framework's lists), so no case is skipped at run time.

Ids name the behaviour, its op, scale factors (when not 1) or root, the dtype, the variant (none for out of
place, the op's plain form; inplace, async, async-inplace) and the job size:
``allgather-int8-3ranks``, ``allreduce-max-int8-async-inplace-3ranks``,
``allreduce-sum-prescale0.5-postscale4-float32-inplace-2ranks``, ``broadcast-root2-bool-inplace-3ranks``,
``alltoall-splits-uint8-async-2ranks``. Pytest puts the framework (and for NumPy the transport) in front:
``numpy-shm-allgather-int8-3ranks``.
Importing this module imports no framework.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

OPS = ("sum", "average", "min", "max", "product")
SCATTER_OPS = ("sum", "average")  # Horovod's reducescatter takes Sum and Average only
FLOAT_SCALES = ((0.5, 4.0), (4.0, 0.25))
# Integer results stay exact: the factors are whole numbers.
INT_SCALES = ((2.0, 1.0), (3.0, 1.0), (1.0, 3.0))


def _torch_has_uint16() -> bool:
    """Whether the installed PyTorch has torch.uint16 (2.3 and later), read from its distribution's version
    so that no framework is imported; True where PyTorch is not installed."""
    try:
        major, minor = importlib.metadata.version("torch").split(".")[:2]
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return True
    return (int(major), int(minor)) >= (2, 3)


@dataclass(frozen=True)
class Framework:
    """What a framework's shim can express: its dtypes and, per behaviour, its variants."""

    dtypes: tuple[str, ...]
    variants: dict[str, tuple[str, ...]]
    transports: tuple[str, ...] = ("shm",)
    # Job sizes: 2, and 3 where the shim's own code runs the collective (the engine's ring and pairwise
    # steps differ between 2 ranks and more).
    rank_counts: tuple[int, ...] = (2, 3)
    zero_dim: bool = True  # 0-d tensors


# Variants: out of place (`allreduce`), in place (`allreduce_`), asynchronous (`allreduce_async`, polled, then
# synchronized) and both (`allreduce_async_`).
HOROVOD_API = {  # numpy and torch: Horovod's names, each with its async and in-place forms where Horovod has them
    "allreduce": ("outofplace", "inplace", "async", "async-inplace"),
    "allreduce-scaled": ("outofplace", "inplace"),
    "grouped-allreduce": ("outofplace", "inplace", "async", "async-inplace"),
    "allgather": ("outofplace", "async"),
    "grouped-allgather": ("outofplace", "async"),
    "broadcast": ("outofplace", "inplace", "async", "async-inplace"),
    "alltoall": ("outofplace", "async"),
    "reducescatter": ("outofplace", "async"),
    "reducescatter-scaled": ("outofplace",),
    "grouped-reducescatter": ("outofplace", "async"),
}

FRAMEWORKS = {
    "numpy": Framework(
        # NumPy has no bfloat16.
        dtypes=("uint8", "uint16", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"),
        variants=HOROVOD_API,
        # rvod.numpy is the engine's plainest client: its cases run over shared memory and over TCP.
        transports=("shm", "tcp"),
    ),
    "torch": Framework(
        # torch.uint16 (PyTorch 2.3 and later, left out before) has almost no ops, but crosses to and from NumPy.
        dtypes=("uint8", *(("uint16",) if _torch_has_uint16() else ()), "int8", "int16", "int32", "int64", "float16",
                "bfloat16", "float32", "float64", "bool"),
        variants=HOROVOD_API,
    ),
    "tensorflow": Framework(
        dtypes=("uint8", "uint16", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                "bool"),
        # TensorFlow tensors are immutable and horovod.tensorflow has no async ops: every op is out of place.
        # These cases run eagerly; workers/tensorflow_ops.py runs every op and dtype inside one tf.function
        # (tracing a function per case would take minutes).
        variants={behaviour: ("outofplace",) for behaviour in HOROVOD_API},
        # The adapter does the same whatever the job size, and a TensorFlow rank takes seconds to start:
        # 3 ranks run through NumPy and PyTorch.
        rank_counts=(2,),
    ),
    "jax": Framework(
        # Every dtype the engine has (int64, uint16 and float64 with jax_enable_x64, which the worker sets).
        dtypes=("uint8", "uint16", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                "bool"),
        # jax.Arrays are immutable and JAX dispatches asynchronously itself: rvod.jax has out-of-place ops only.
        # These cases run eagerly; workers/jax_ops.py runs every op inside jax.jit.
        variants={behaviour: ("outofplace",) for behaviour in HOROVOD_API},
        # As for TensorFlow: the adapter does the same whatever the job size (test_jax.py runs 3 ranks).
        rank_counts=(2,),
    ),
    "mxnet": Framework(
        # MXNet 1.9's NDArray has no int16 or uint16, and rvod.mxnet refuses bool as horovod.mxnet does
        # (workers/mxnet_collectives.py checks the message).
        dtypes=("uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"),
        # horovod.mxnet has no async ops.
        variants={behaviour: tuple(v for v in variants if not v.startswith("async"))
                  for behaviour, variants in HOROVOD_API.items()},
        # mx.nd arrays have no 0-d shape (mx.np arrays do: test_mxnet_collectives.py covers them).
        zero_dim=False,
        # As for TensorFlow: the adapter does the same whatever the job size.
        rank_counts=(2,),
    ),
}


@dataclass(frozen=True)
class Case:
    """One case: a behaviour (the body that runs it) and its parameters."""

    id: str
    behaviour: str
    dtype: str
    variant: str
    ranks: int
    op: str | None = None
    root: int | None = None
    prescale: float = 1.0
    postscale: float = 1.0
    splits: bool = False


def _number(value: float) -> str:
    return f"{value:g}"


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def cases_for(framework: str, ranks: int) -> list[Case]:
    """Every case of `framework` in a job of `ranks` ranks, in the order the worker runs them."""
    spec = FRAMEWORKS[framework]
    out: list[Case] = []
    tail = f"{ranks}ranks"

    def add(behaviour, dtype, variant, name, **params):
        marker = "" if variant == "outofplace" else f"-{variant}"  # out of place is the op's plain name
        out.append(Case(f"{name}-{dtype}{marker}-{tail}", behaviour, dtype, variant, ranks, **params))

    def variants(behaviour):
        return spec.variants.get(behaviour, ())

    numeric = [d for d in spec.dtypes if d != "bool"]
    for dtype in spec.dtypes:
        # Average of booleans has no boolean result; Horovod refuses it.
        ops = [op for op in OPS if not (dtype == "bool" and op == "average")]
        for op in ops:
            for variant in variants("allreduce"):
                add("allreduce", dtype, variant, f"allreduce-{op}", op=op)
        for op in ops:
            for variant in variants("grouped-allreduce"):
                add("grouped_allreduce", dtype, variant, f"grouped-allreduce-{op}", op=op)
    for dtype in numeric:
        scales = FLOAT_SCALES if _is_float(dtype) else INT_SCALES
        # Scaled integer products would overflow the small integer types.
        ops = OPS if _is_float(dtype) else [op for op in OPS if op != "product"]
        for op in ops:
            for pre, post in scales:
                for variant in variants("allreduce-scaled"):
                    add("allreduce", dtype, variant,
                        f"allreduce-{op}-prescale{_number(pre)}-postscale{_number(post)}", op=op, prescale=pre,
                        postscale=post)
    for dtype in spec.dtypes:
        for variant in variants("allgather"):
            add("allgather", dtype, variant, "allgather")
        for variant in variants("grouped-allgather"):
            add("grouped_allgather", dtype, variant, "grouped-allgather")
    for dtype in spec.dtypes:
        for root in range(ranks):
            for variant in variants("broadcast"):
                add("broadcast", dtype, variant, f"broadcast-root{root}", root=root)
    for dtype in spec.dtypes:
        for splits in (False, True):
            for variant in variants("alltoall"):
                add("alltoall", dtype, variant, "alltoall-splits" if splits else "alltoall-even", splits=splits)
    # Reducescatter reduces with Sum or Average, which bool has no exact meaning for (Horovod takes numeric
    # tensors only).
    for dtype in numeric:
        scales = FLOAT_SCALES if _is_float(dtype) else INT_SCALES
        for op in SCATTER_OPS:
            for variant in variants("reducescatter"):
                add("reducescatter", dtype, variant, f"reducescatter-{op}", op=op)
            for pre, post in scales:
                for variant in variants("reducescatter-scaled"):
                    add("reducescatter", dtype, variant,
                        f"reducescatter-{op}-prescale{_number(pre)}-postscale{_number(post)}", op=op,
                        prescale=pre, postscale=post)
            for variant in variants("grouped-reducescatter"):
                add("grouped_reducescatter", dtype, variant, f"grouped-reducescatter-{op}", op=op)
    ids = [case.id for case in out]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return out


def case_table(framework: str, ranks: int) -> dict[str, Case]:
    return {case.id: case for case in cases_for(framework, ranks)}
