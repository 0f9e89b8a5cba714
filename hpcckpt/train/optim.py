"""Optimizers whose state is part of the model state that checkpoints protect.

Two choices shape this module:
- `update()` handles ONE parameter, so the trainer can update a layer as soon as its
  gradient allreduce completes, while lower layers are still in backprop.
- Every state tensor is allocated in `__init__` and only ever written in place, so the
  checkpoint engine can register `state_arrays()` once and always see the live values;
  the few scalars (Adam step counts) travel as JSON through `scalar_state()`.
"""

from __future__ import annotations

from hpcckpt.errors import ConfigError, IncompatibleCheckpointError

OPTIMIZER_KINDS = ("sgd", "adam")


class Optimizer:
    """Base class: per-parameter in-place updates, preallocated state."""

    kind = "base"

    def __init__(self, parameters, xp):
        self.xp = xp
        self._names = [name for name, _ in parameters]
        if len(set(self._names)) != len(self._names):
            raise ValueError(f"parameter names must be unique: {self._names}")
        self._state: list[tuple[str, object]] = []

    def update(self, name: str, param, grad) -> None:
        """Update `param` (the parameter called `name`) in place from `grad`."""
        raise NotImplementedError

    def state_arrays(self) -> list[tuple[str, object]]:
        """Every state tensor as ("<param>/<slot>", array); the same objects on every call."""
        return list(self._state)

    def scalar_state(self) -> dict:
        """JSON-able scalars that complete the state (besides `state_arrays()`)."""
        return {"kind": self.kind}

    def load_scalar_state(self, state: dict) -> None:
        """Restore what `scalar_state()` returned; array state is restored in place by the caller."""
        if state.get("kind") != self.kind:
            raise IncompatibleCheckpointError(
                f"checkpoint holds optimizer state of kind {state.get('kind')!r}, "
                f"but this job's optimizer.kind is {self.kind!r}"
            )

    def _check_known(self, name: str) -> None:
        if name not in self._slots:
            raise KeyError(f"unknown parameter {name!r}; this optimizer was built for {self._names}")


class SGD(Optimizer):
    """SGD with (heavy-ball) momentum and L2 weight decay, as torch.optim.SGD:
    d = g + wd * p;  buf = momentum * buf + d;  p -= lr * buf.
    With momentum 0 no buffer exists and the step is p -= lr * d.
    """

    kind = "sgd"

    def __init__(self, parameters, xp, lr, momentum=0.0, weight_decay=0.0):
        super().__init__(parameters, xp)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self._slots = {}
        for name, param in parameters:
            buffer = xp.zeros_like(param) if self.momentum else None
            self._slots[name] = buffer
            if buffer is not None:
                self._state.append((f"{name}/momentum", buffer))

    def update(self, name, param, grad):
        self._check_known(name)
        direction = grad
        if self.weight_decay:
            direction = grad + self.weight_decay * param
        buffer = self._slots[name]
        if buffer is not None:
            buffer *= self.momentum
            buffer += direction
            direction = buffer
        param -= self.lr * direction


class Adam(Optimizer):
    """Adam with bias correction (Kingma & Ba) and L2 weight decay added to the gradient,
    as torch.optim.Adam. The step count is kept per parameter, so the bias correction stays
    right however the trainer interleaves per-layer updates (or skips a layer)."""

    kind = "adam"

    def __init__(self, parameters, xp, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
        super().__init__(parameters, xp)
        self.lr = float(lr)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self._slots = {}
        self.steps = {}
        for name, param in parameters:
            first, second = xp.zeros_like(param), xp.zeros_like(param)
            self._slots[name] = (first, second)
            self.steps[name] = 0
            self._state += [(f"{name}/adam_m", first), (f"{name}/adam_v", second)]

    def update(self, name, param, grad):
        self._check_known(name)
        xp = self.xp
        if self.weight_decay:
            grad = grad + self.weight_decay * param
        first, second = self._slots[name]
        self.steps[name] += 1
        step = self.steps[name]
        first *= self.beta1
        first += (1 - self.beta1) * grad
        second *= self.beta2
        second += (1 - self.beta2) * (grad * grad)
        first_hat = first / (1 - self.beta1 ** step)
        second_hat = second / (1 - self.beta2 ** step)
        param -= self.lr * first_hat / (xp.sqrt(second_hat) + self.eps)

    def scalar_state(self):
        return {"kind": self.kind, "adam_steps": dict(self.steps)}

    def load_scalar_state(self, state):
        super().load_scalar_state(state)
        steps = state.get("adam_steps", {})
        if set(steps) != set(self.steps):
            raise IncompatibleCheckpointError(
                f"checkpoint has Adam step counts for {sorted(steps)}, this model has {sorted(self.steps)}"
            )
        self.steps = {name: int(steps[name]) for name in self._names}


def build_optimizer(opt_cfg, parameters: list[tuple[str, object]], xp) -> Optimizer:
    """The optimizer `opt_cfg.kind` over `parameters` (the model's (name, array) list).

    `opt_cfg` is duck-typed: kind, lr, momentum, beta1, beta2, eps, weight_decay.
    """
    kind = opt_cfg.kind
    if kind not in OPTIMIZER_KINDS:
        raise ConfigError(
            f"optimizer.kind = {kind!r}: allowed are {', '.join(map(repr, OPTIMIZER_KINDS))}"
        )
    if not opt_cfg.lr > 0:
        raise ConfigError(f"optimizer.lr = {opt_cfg.lr!r}: must be positive")
    weight_decay = getattr(opt_cfg, "weight_decay", 0.0)
    if kind == "sgd":
        return SGD(parameters, xp, opt_cfg.lr, getattr(opt_cfg, "momentum", 0.0), weight_decay)
    return Adam(
        parameters,
        xp,
        opt_cfg.lr,
        getattr(opt_cfg, "beta1", 0.9),
        getattr(opt_cfg, "beta2", 0.999),
        getattr(opt_cfg, "eps", 1e-8),
        weight_decay,
    )
