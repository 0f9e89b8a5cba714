"""The models the trainer runs: an MLP, a CANDLE-NT3-like 1-D convolutional net, and the MLP of
an embedding model (its input: the dense features and each field's embedding, looked up in a
keyed table by train/embedding.py, which takes the MLP's input gradient back).

Both are plain array code (NumPy or CuPy, whichever holds the parameters) plus the fused
kernels of `hpcckpt.train.kernels`. They are built for data-parallel training with
checkpoints taken during backprop:

- `parameters()` returns the same array objects on every call, so the optimizer can update
  them in place and the checkpoint engine can protect them once, at start-up.
- `backward()` is a generator that hands over each layer's gradients as soon as they exist,
  output layer first, so the caller can allreduce (and then update) one layer while the
  layers below it are still being differentiated. A layer's input gradient is computed
  *before* its parameter gradients are yielded, so updating those parameters in place right
  away cannot corrupt the gradients of the layers below.

Activations are kept channels-last, (batch, length, channels), inside the conv net, so a
conv output is laid out like a dense output with (batch, length) as rows: one im2col matmul
per layer, and biases always broadcast over the last axis.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from hpcckpt.errors import ConfigError
from hpcckpt.train.kernels import bias_activation, bias_activation_backward

MODEL_KINDS = ("mlp", "conv1d", "embedding")
HIDDEN_ACTIVATIONS = ("relu", "tanh")
DTYPES = ("float32", "float64")
PADDINGS = ("same", "valid")


def _features(x) -> int:
    """Values per sample: reshape cannot infer -1 for an empty batch (a rank whose share of
    the epoch's last, partial batch is nothing), so the size is given."""
    size = 1
    for dim in x.shape[1:]:
        size *= int(dim)
    return size


def _init_weight(rng: np.random.Generator, shape, fan_in: int, fan_out: int, activation: str, dtype):
    # He init keeps ReLU activations at unit scale; Glorot suits tanh and the linear output.
    if activation == "relu":
        std = np.sqrt(2.0 / fan_in)
    else:
        std = np.sqrt(2.0 / (fan_in + fan_out))
    # Drawn in float64 and then cast, so float32 and float64 models start from the same values.
    return (rng.standard_normal(shape) * std).astype(dtype)


class Dense:
    """y = act(x @ weight + bias); weight is (in_features, out_features) so no transpose is
    needed in the forward pass."""

    def __init__(self, name, in_features, out_features, activation, dtype, rng, xp, needs_input_grad):
        self.name = name
        self.activation = activation
        self.needs_input_grad = needs_input_grad
        self.weight = xp.asarray(
            _init_weight(rng, (in_features, out_features), in_features, out_features, activation, dtype)
        )
        self.bias = xp.zeros(out_features, dtype=dtype)
        self._x = self._out = None

    def parameters(self):
        return [(f"{self.name}.weight", self.weight), (f"{self.name}.bias", self.bias)]

    def forward(self, x, train):
        out = bias_activation(x @ self.weight, self.bias, self.activation)
        if train:
            self._x, self._out = x, out
        return out

    def backward(self, grad_out):
        """(grad_input or None, [(name, grad), ...])."""
        grad_z = bias_activation_backward(grad_out, self._out, self.activation)
        grad_input = grad_z @ self.weight.T if self.needs_input_grad else None
        grads = [
            (f"{self.name}.weight", self._x.T @ grad_z),
            (f"{self.name}.bias", grad_z.sum(axis=0)),
        ]
        self._x = self._out = None
        return grad_input, grads


class Conv1D:
    """Stride-1 1-D convolution on channels-last input (batch, length, in_channels), fused
    with bias and activation; weight is (out_channels, in_channels, kernel_size).

    im2col: a sliding-window view of the (padded) input becomes a (batch*length_out,
    kernel_size*in_channels) matrix, so the convolution is one matmul.
    """

    def __init__(self, name, in_channels, out_channels, kernel_size, padding, activation, dtype, rng, xp,
                 needs_input_grad):
        self.name = name
        self.xp = xp
        self.kernel_size = kernel_size
        self.padding = padding
        self.activation = activation
        self.needs_input_grad = needs_input_grad
        fan_in, fan_out = in_channels * kernel_size, out_channels * kernel_size
        self.weight = xp.asarray(
            _init_weight(rng, (out_channels, in_channels, kernel_size), fan_in, fan_out, activation, dtype)
        )
        self.bias = xp.zeros(out_channels, dtype=dtype)
        self._cols = self._out = None

    def output_length(self, length: int) -> int:
        return length if self.padding == "same" else length - self.kernel_size + 1

    def _pad_widths(self):
        if self.padding == "valid":
            return 0, 0
        left = (self.kernel_size - 1) // 2
        return left, self.kernel_size - 1 - left

    def parameters(self):
        return [(f"{self.name}.weight", self.weight), (f"{self.name}.bias", self.bias)]

    def forward(self, x, train):
        xp = self.xp
        batch, _, in_channels = x.shape
        left, right = self._pad_widths()
        if left or right:
            x = xp.pad(x, ((0, 0), (left, right), (0, 0)))
        # Rows are ordered (kernel, in_channels), not the weight's (in_channels, kernel):
        # copying the window view in that order moves contiguous channel runs and was ~10x
        # faster on CPU; the small weight is permuted to match instead.
        windows = xp.lib.stride_tricks.sliding_window_view(x, self.kernel_size, axis=1)
        length_out = windows.shape[1]
        cols = windows.transpose(0, 1, 3, 2).reshape(batch * length_out, self.kernel_size * in_channels)
        weight_matrix = self.weight.transpose(0, 2, 1).reshape(self.weight.shape[0], -1)
        # Explicit sizes: -1 cannot be inferred for a rank whose share of the batch is empty.
        z = (cols @ weight_matrix.T).reshape(batch, length_out, self.weight.shape[0])
        out = bias_activation(z, self.bias, self.activation)
        if train:
            self._cols, self._out = cols, out
        return out

    def backward(self, grad_out):
        xp = self.xp
        out_channels, in_channels, kernel = self.weight.shape
        grad_z = bias_activation_backward(grad_out, self._out, self.activation)
        batch, length_out, _ = grad_z.shape
        grad_z_rows = grad_z.reshape(batch * length_out, out_channels)
        grad_input = None
        if self.needs_input_grad:
            # col2im as one small matmul per kernel tap, added at the tap's shift (output l
            # read padded input l + j through tap j). Materialising the whole column
            # gradient first cost ~4x more on CPU.
            left, right = self._pad_widths()
            grad_padded = xp.zeros((batch, length_out + kernel - 1, in_channels), dtype=grad_z.dtype)
            for j in range(kernel):
                tap = (grad_z_rows @ self.weight[:, :, j]).reshape(batch, length_out, in_channels)
                grad_padded[:, j:j + length_out, :] += tap
            grad_input = grad_padded[:, left:grad_padded.shape[1] - right, :]
        grad_weight = (grad_z_rows.T @ self._cols).reshape(out_channels, kernel, in_channels)
        grads = [
            (f"{self.name}.weight", xp.ascontiguousarray(grad_weight.transpose(0, 2, 1))),
            (f"{self.name}.bias", grad_z_rows.sum(axis=0)),
        ]
        self._cols = self._out = None
        return grad_input, grads


class MaxPool1D:
    """Non-overlapping max-pool over the length axis of (batch, length, channels); a tail
    shorter than `pool` is dropped (floor), as Keras' MaxPooling1D does."""

    def __init__(self, pool, xp):
        self.pool = pool
        self.xp = xp
        self._mask = self._input_shape = None

    def output_length(self, length: int) -> int:
        return length // self.pool

    def forward(self, x, train):
        batch, length, channels = x.shape
        pooled_length = length // self.pool
        windows = x[:, :pooled_length * self.pool, :].reshape(batch, pooled_length, self.pool, channels)
        out = windows.max(axis=2)
        if train:
            self._mask = self._first_max_mask(windows, out)
            self._input_shape = x.shape
        return out

    def _first_max_mask(self, windows, out):
        # The gradient goes to the first maximum of a window only (as argmax would pick),
        # so ties such as several ReLU zeros do not duplicate it. A loop over the few
        # window positions ran ~5x faster than argmax over the strided pool axis.
        xp = self.xp
        mask = xp.empty(windows.shape, dtype=bool)
        taken = xp.zeros(out.shape, dtype=bool)
        for position in range(self.pool):
            is_max = windows[:, :, position, :] == out
            is_max &= ~taken
            mask[:, :, position, :] = is_max
            taken |= is_max
        return mask

    def backward(self, grad_out):
        batch, length, channels = self._input_shape
        pooled_length = grad_out.shape[1]
        grad_input = (self._mask * grad_out[:, :, None, :]).reshape(batch, pooled_length * self.pool, channels)
        if grad_input.shape[1] != length:  # the dropped tail gets no gradient
            padded = self.xp.zeros(self._input_shape, dtype=grad_out.dtype)
            padded[:, :grad_input.shape[1], :] = grad_input
            grad_input = padded
        self._mask = self._input_shape = None
        return grad_input, []


class Flatten:
    """(batch, length, channels) -> (batch, length*channels) between the conv and dense parts."""

    def __init__(self):
        self._input_shape = None

    def forward(self, x, train):
        if train:
            self._input_shape = x.shape
        return x.reshape(x.shape[0], _features(x))

    def backward(self, grad_out):
        grad_input = grad_out.reshape(self._input_shape)
        self._input_shape = None
        return grad_input, []


class Model:
    """A stack of layers; see the module docstring for the contract with the trainer."""

    def __init__(self, kind, layers, input_layout, dtype, xp):
        self.kind = kind
        self.layers = layers
        self.dtype = np.dtype(dtype)
        self.xp = xp
        self._input_layout = input_layout  # "flat" (MLP) or "channels_first" (conv)
        self._parameters = [p for layer in layers if hasattr(layer, "parameters") for p in layer.parameters()]
        self._has_cached_forward = False
        self.input_grad = None  # after a backward() run to its end: the gradient of the input (embedding model)

    def parameters(self) -> list[tuple[str, object]]:
        """(name, array) from input to output; the same array objects on every call."""
        return list(self._parameters)

    def _prepare_input(self, x):
        x = self.xp.asarray(x, dtype=self.dtype)
        if self._input_layout == "flat":
            return x.reshape(x.shape[0], _features(x))
        if x.ndim == 2:  # (batch, length): a single channel
            return x[:, :, None]
        return x.transpose(0, 2, 1)  # (batch, channels, length) -> channels-last

    def forward(self, x, train: bool = True):
        """Logits (batch, n_classes). With train=True, keeps what backward() needs."""
        h = self._prepare_input(x)
        for layer in self.layers:
            h = layer.forward(h, train)
        self._has_cached_forward = self._has_cached_forward or train
        return h

    def backward(self, grad_logits) -> Iterator[tuple[str, object]]:
        """Yield (param_name, grad) layer by layer from the output toward the input.

        A generator: nothing is computed until it is iterated, and each layer's work runs
        when the previous layer's gradients have been consumed. Gradients are fresh arrays
        the caller may modify (e.g. an in-place allreduce).
        """
        if not self._has_cached_forward:
            raise RuntimeError("Model.backward() needs a forward(x, train=True) since the last backward()")
        self._has_cached_forward = False
        grad = grad_logits
        self.input_grad = None
        for layer in reversed(self.layers):
            grad, grads = layer.backward(grad)
            yield from grads
            if grad is None:  # the first parameterised layer needs no input gradient
                break
        self.input_grad = grad


def _config_error(key, value, allowed):
    return ConfigError(f"model.{key} = {value!r}: allowed are {', '.join(map(repr, allowed))}")


def build_model(model_cfg, input_shape: tuple[int, ...], n_classes: int, xp, rng: np.random.Generator,
                embedded: int = 0) -> Model:
    """Build the model `model_cfg.kind` for samples of `input_shape` (batch excluded).

    Weights are drawn from `rng` on the host in the model dtype and then moved to `xp`, so
    CPU and GPU runs with the same seed start from identical parameters.
    `model_cfg` is duck-typed (kind, hidden, activation, conv_channels, kernel_size, pool,
    dtype; optional padding, "same" by default). `embedded`: for the embedding model, the
    embedding values appended to each sample's dense features (fields x embedding_dim); its
    first layer then gives the input gradient they need.
    """
    kind = model_cfg.kind
    if kind not in MODEL_KINDS:
        raise _config_error("kind", kind, MODEL_KINDS)
    activation = model_cfg.activation
    if activation not in HIDDEN_ACTIVATIONS:
        raise _config_error("activation", activation, HIDDEN_ACTIVATIONS)
    dtype = model_cfg.dtype
    if dtype not in DTYPES:
        raise _config_error("dtype", dtype, DTYPES)
    hidden = tuple(int(h) for h in model_cfg.hidden)
    if any(h <= 0 for h in hidden):
        raise ConfigError(f"model.hidden = {model_cfg.hidden!r}: every layer width must be positive")
    if int(n_classes) < 2:
        raise ConfigError(f"n_classes = {n_classes}: need at least 2 classes")
    input_shape = tuple(int(d) for d in input_shape)

    layers: list = []
    if kind == "embedding" and embedded <= 0:
        raise ConfigError("model.kind = 'embedding' needs categorical fields in the data: data.source = 'clicks', or "
                          "an HDF5 file written by `hpcckpt make-data --clicks`")
    if kind in ("mlp", "embedding"):
        if not input_shape:
            raise ConfigError("input_shape is empty: the MLP needs at least one feature")
        features = int(np.prod(input_shape)) + (int(embedded) if kind == "embedding" else 0)
        layout = "flat"
    else:
        layers, features = _conv_stack(model_cfg, input_shape, activation, dtype, rng, xp)
        layers.append(Flatten())
        layout = "channels_first"

    widths = (features, *hidden, int(n_classes))
    for index in range(len(widths) - 1):
        is_output = index == len(widths) - 2
        layers.append(
            Dense(
                f"dense{index}",
                widths[index],
                widths[index + 1],
                "none" if is_output else activation,
                dtype,
                rng,
                xp,
                needs_input_grad=index > 0 or kind in ("conv1d", "embedding"),
            )
        )
    return Model(kind, layers, layout, dtype, xp)


def _conv_stack(model_cfg, input_shape, activation, dtype, rng, xp):
    if len(input_shape) == 1:
        channels, length = 1, input_shape[0]
    elif len(input_shape) == 2:
        channels, length = input_shape
    else:
        raise ConfigError(
            f"input_shape {input_shape}: model.kind = 'conv1d' needs (length,) or (channels, length)"
        )
    kernel_size, pool = int(model_cfg.kernel_size), int(model_cfg.pool)
    padding = getattr(model_cfg, "padding", "same")
    if kernel_size < 1:
        raise ConfigError(f"model.kernel_size = {kernel_size}: must be at least 1")
    if pool < 1:
        raise ConfigError(f"model.pool = {pool}: must be at least 1")
    if padding not in PADDINGS:
        raise _config_error("padding", padding, PADDINGS)
    conv_channels = tuple(int(c) for c in model_cfg.conv_channels)
    if not conv_channels or any(c <= 0 for c in conv_channels):
        raise ConfigError(f"model.conv_channels = {model_cfg.conv_channels!r}: need positive channel counts")

    layers = []
    for index, out_channels in enumerate(conv_channels):
        conv = Conv1D(f"conv{index}", channels, out_channels, kernel_size, padding, activation, dtype, rng, xp,
                      needs_input_grad=index > 0)
        pooling = MaxPool1D(pool, xp)
        new_length = pooling.output_length(conv.output_length(length))
        if new_length < 1:
            raise ConfigError(
                f"model.conv_channels = {conv_channels}, kernel_size = {kernel_size}, pool = {pool}: "
                f"input length {input_shape[-1]} shrinks to nothing after conv{index}"
            )
        layers += [conv, pooling]
        channels, length = out_channels, new_length
    return layers, channels * length
