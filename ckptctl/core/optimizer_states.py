"""What each of torch's optimizers keeps per param, and the shape of each state.

`inspect` calls a per-param state data loss when it holds fewer elements than its param (a
plain per-rank tensor of which DCP kept one rank's copy). That is only right for states shaped
like the param: Adafactor keeps factored second moments, a row and a column of them, smaller
by design, and several optimizers keep scalars besides `step`. The table says, state by state,
which shape torch 2.13's optimizers give it (read from `torch/optim/*.py`), and a test steps each
optimizer for real and checks every state it makes against it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class StateShape(enum.Enum):
    """How a per-param optimizer state's shape follows from its param's."""

    PARAM = "the param's"
    SCALAR = "one number"
    ROWS = "the param's, its last dim 1"
    """Adafactor's `row_var` of a param of 2 dims or more: a mean over the last dim, kept as 1."""
    COLUMNS = "the param's, its next-to-last dim 1"
    """Adafactor's `col_var`: a mean over the next-to-last dim, kept as 1."""


P, S = StateShape.PARAM, StateShape.SCALAR

TORCH_OPTIMIZERS: Mapping[str, Mapping[str, StateShape]] = {
    "Adam": {"step": S, "exp_avg": P, "exp_avg_sq": P, "max_exp_avg_sq": P},
    "AdamW": {"step": S, "exp_avg": P, "exp_avg_sq": P, "max_exp_avg_sq": P},
    "Adamax": {"step": S, "exp_avg": P, "exp_inf": P},
    "NAdam": {"step": S, "mu_product": S, "exp_avg": P, "exp_avg_sq": P},
    "RAdam": {"step": S, "exp_avg": P, "exp_avg_sq": P},
    "Adagrad": {"step": S, "sum": P},
    "Adadelta": {"step": S, "square_avg": P, "acc_delta": P},
    "RMSprop": {"step": S, "square_avg": P, "momentum_buffer": P, "grad_avg": P},
    "Rprop": {"step": S, "prev": P, "step_size": P},
    "ASGD": {"step": S, "eta": S, "mu": S, "ax": P},
    "SGD": {"momentum_buffer": P},
    "Muon": {"momentum_buffer": P},
    "Adafactor": {"step": S, "row_var": StateShape.ROWS, "col_var": StateShape.COLUMNS, "variance": P},
}
"""torch.optim's optimizers and the states each keeps per param (`variance` is Adafactor's for a
param of one dim, where it keeps no row and column)."""


STATE_SHAPES: Mapping[str, StateShape] = {name: shape for states in TORCH_OPTIMIZERS.values()
                                          for name, shape in states.items()}
"""Each state name's shape, the same in every optimizer that uses the name."""


def expected_shape(state: str, param_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape torch gives state `state` of a param of `param_shape`; None where any shape of the
    param's element count is right (a state shaped like the param may be saved flat), or for a
    state torch does not name."""
    kind = STATE_SHAPES.get(state)
    if kind is StateShape.ROWS and len(param_shape) >= 2:
        return (*param_shape[:-1], 1)
    if kind is StateShape.COLUMNS and len(param_shape) >= 2:
        return (*param_shape[:-2], 1, param_shape[-1])
    return None


def is_scalar(state: str) -> bool:
    """Whether the state is one number whatever its param (0-d, or `[1]` in some optimizers)."""
    return STATE_SHAPES.get(state) is StateShape.SCALAR
