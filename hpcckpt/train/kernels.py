"""Fused training kernels, each with a NumPy twin and a CuPy kernel.

The implementation is picked from the module that owns the inputs, so the models hold one
code path for CPU and GPU. CuPy is imported only when a CuPy array arrives: CPU-only nodes
never need it installed.

The NumPy twins use only elementwise ufuncs and NumPy's fixed-order (pairwise) reductions,
so they give the same bits on every run; restarts that must replay training exactly depend
on that.
"""

from __future__ import annotations

import numpy as np

from hpcckpt.cluster.backend import array_module
from hpcckpt.errors import DataError

ACTIVATIONS = ("relu", "tanh", "none")


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: allowed are {', '.join(map(repr, ACTIVATIONS))}")


def _bias_broadcast_shape(z_ndim: int, bias_size: int, axis: int) -> tuple[int, ...]:
    axis = axis % z_ndim
    shape = [1] * z_ndim
    shape[axis] = bias_size
    return tuple(shape)


# --------------------------------------------------------------------------------------
# bias + activation


def bias_activation(z, bias, activation: str, axis: int = -1):
    """out = act(z + bias), `bias` (1-D) broadcast along `axis` of `z` (the last by default).

    The models keep activations channels-last — dense (batch, features), conv
    (batch, length, channels) — so they always use the default axis; `axis` exists for
    callers with channels-first data. Returns a new array; `z` is left untouched.
    """
    _check_activation(activation)
    if bias.shape[0] != z.shape[axis]:
        raise ValueError(f"bias of size {bias.shape[0]} does not match axis {axis} of z {z.shape}")
    bias_view = bias.reshape(_bias_broadcast_shape(z.ndim, bias.shape[0], axis))
    xp = array_module(z)
    if xp is np:
        return _bias_activation_numpy(z, bias_view, activation)
    return _cupy_kernels().bias_activation[activation](z, bias_view)


def _bias_activation_numpy(z, bias_view, activation):
    out = z + bias_view
    if activation == "relu":
        np.maximum(out, 0, out=out)
    elif activation == "tanh":
        np.tanh(out, out=out)
    return out


def bias_activation_backward(grad_out, out, activation: str):
    """dL/dz from dL/dout and the activation's output (never the pre-activation).

    relu' = [out > 0] and tanh' = 1 - out², so the forward pass need not keep z. For
    "none" `grad_out` itself is returned (no copy): callers must not write into it.
    """
    _check_activation(activation)
    if activation == "none":
        return grad_out
    xp = array_module(grad_out)
    if xp is np:
        if activation == "relu":
            return np.where(out > 0, grad_out, 0).astype(grad_out.dtype, copy=False)
        return grad_out * (1 - out * out)
    return _cupy_kernels().activation_backward[activation](grad_out, out)


# --------------------------------------------------------------------------------------
# softmax + cross entropy


def softmax_cross_entropy(logits, labels):
    """(mean loss over the local batch as a Python float, dL/dlogits).

    `logits` is (batch, classes), `labels` integer class indices of shape (batch,). The
    gradient is (softmax - onehot) / batch, i.e. of the *local* mean loss: the trainer's
    allreduce-average over ranks with equal local batches then yields the gradient of the
    global mean. The row maximum is subtracted first so large logits cannot overflow exp.
    Out-of-range labels raise DataError on NumPy; on CuPy (checking would cost a device
    sync) they make the loss NaN instead.
    """
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"logits {logits.shape} and labels {labels.shape}: expected (B, C) and (B,)")
    xp = array_module(logits)
    if xp is np:
        return _softmax_cross_entropy_numpy(logits, np.asarray(labels))
    return _cupy_kernels().softmax_cross_entropy(logits, labels)


def _softmax_cross_entropy_numpy(logits, labels):
    batch, n_classes = logits.shape
    if batch and (labels.min() < 0 or labels.max() >= n_classes):
        raise DataError(
            f"labels must lie in [0, {n_classes}); got values in [{labels.min()}, {labels.max()}]"
        )
    rows = np.arange(batch)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    row_loss = np.log(total[:, 0]) - shifted[rows, labels]
    grad = exp
    grad /= total
    grad[rows, labels] -= 1
    grad /= batch
    return float(row_loss.mean()), grad


# --------------------------------------------------------------------------------------
# CuPy kernels, built on first use


class _CupyKernels:
    """Holds the compiled-on-demand CuPy kernels; one instance per process."""

    _SOFTMAX_BLOCK = 256  # threads per row; a power of two for the tree reductions

    # One block per row: block-wide max, then sum of exp, then the gradient row. double
    # accumulation is not used for float32 so results stay close to the NumPy twin, which
    # also reduces in float32.
    _SOFTMAX_SOURCE = r"""
    extern "C" __global__ void hpcckpt_softmax_xent_{T}(
            const {T}* logits, const long long* labels, {T}* grad, {T}* row_loss,
            const int n_classes, const {T} batch) {{
        __shared__ {T} scratch[{BLOCK}];
        const long long row = blockIdx.x;
        const int tid = threadIdx.x;
        const {T}* x = logits + row * n_classes;
        {T}* g = grad + row * n_classes;

        {T} local_max = x[0];  // a real element, so no infinity constant is needed
        for (int j = tid; j < n_classes; j += blockDim.x) local_max = fmax(local_max, x[j]);
        scratch[tid] = local_max;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {{
            if (tid < s) scratch[tid] = fmax(scratch[tid], scratch[tid + s]);
            __syncthreads();
        }}
        const {T} row_max = scratch[0];
        __syncthreads();  // everyone has read scratch[0] before it is reused

        {T} local_sum = 0;
        for (int j = tid; j < n_classes; j += blockDim.x) local_sum += exp(x[j] - row_max);
        scratch[tid] = local_sum;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {{
            if (tid < s) scratch[tid] += scratch[tid + s];
            __syncthreads();
        }}
        const {T} total = scratch[0];

        const long long label = labels[row];
        for (int j = tid; j < n_classes; j += blockDim.x) {{
            const {T} p = exp(x[j] - row_max) / total;
            g[j] = (p - (j == label ? ({T})1 : ({T})0)) / batch;
        }}
        if (tid == 0) {{
            if (label >= 0 && label < n_classes) row_loss[row] = log(total) - (x[label] - row_max);
            else row_loss[row] = ({T})nan("");
        }}
    }}
    """

    def __init__(self):
        import cupy

        self.cupy = cupy
        bias_ops = {
            "relu": "T v = z + b; out = v > (T)0 ? v : (T)0",
            "tanh": "out = tanh(z + b)",
            "none": "out = z + b",
        }
        self.bias_activation = {
            name: cupy.ElementwiseKernel("T z, T b", "T out", op, f"hpcckpt_bias_{name}")
            for name, op in bias_ops.items()
        }
        backward_ops = {
            "relu": "grad_z = out > (T)0 ? grad_out : (T)0",
            "tanh": "grad_z = grad_out * ((T)1 - out * out)",
        }
        self.activation_backward = {
            name: cupy.ElementwiseKernel(
                "T grad_out, T out", "T grad_z", op, f"hpcckpt_{name}_backward"
            )
            for name, op in backward_ops.items()
        }
        self._softmax = {}

    def _softmax_kernel(self, dtype):
        type_name = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}.get(np.dtype(dtype))
        if type_name is None:
            raise TypeError(f"softmax_cross_entropy supports float32/float64, not {dtype}")
        if type_name not in self._softmax:
            source = self._SOFTMAX_SOURCE.format(T=type_name, BLOCK=self._SOFTMAX_BLOCK)
            self._softmax[type_name] = self.cupy.RawKernel(source, f"hpcckpt_softmax_xent_{type_name}")
        return self._softmax[type_name]

    def softmax_cross_entropy(self, logits, labels):
        cupy = self.cupy
        batch, n_classes = logits.shape
        logits = cupy.ascontiguousarray(logits)
        labels = cupy.ascontiguousarray(cupy.asarray(labels, dtype=cupy.int64))
        grad = cupy.empty_like(logits)
        row_loss = cupy.empty(batch, dtype=logits.dtype)
        if batch:
            kernel = self._softmax_kernel(logits.dtype)
            kernel(
                (batch,),
                (self._SOFTMAX_BLOCK,),
                (logits, labels, grad, row_loss, np.int32(n_classes), logits.dtype.type(batch)),
            )
        return float(row_loss.mean()), grad


_kernels: _CupyKernels | None = None


def _cupy_kernels() -> _CupyKernels:
    global _kernels
    if _kernels is None:
        _kernels = _CupyKernels()
    return _kernels
