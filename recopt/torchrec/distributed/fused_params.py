"""A sharder's ``fused_params`` (fbgemm's table-batched-embedding arguments, as TorchRec passes
them) mapped to recopt's `FusedOptimizerConfig`; what has no recopt equivalent is refused.

``{"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}`` is
``FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05, eps=1e-8)``: fbgemm's defaults
(learning rate 0.01, eps 1e-8) apply to what is not given, as under TorchRec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recopt.kernels.config import FusedOptimizerConfig

# fbgemm EmbOptimType value -> recopt fused optimizer (same update).
EMB_OPTIM_TYPES: dict[str, str] = {
    "sgd": "sgd",
    "exact_sgd": "sgd",
    "exact_adagrad": "adagrad",
    "adagrad": "adagrad",
    "exact_row_wise_adagrad": "row_wise_adagrad",
    "row_wise_adagrad": "row_wise_adagrad",
    "adam": "adam",
    "partial_row_wise_adam": "row_wise_adam",
    "lamb": "lamb",
    "partial_row_wise_lamb": "row_wise_lamb",
}
FBGEMM_DEFAULTS: dict[str, Any] = {"lr": 0.01, "eps": 1e-8}
# fused_params key -> FusedOptimizerConfig field.
_FIELDS = {
    "learning_rate": "lr",
    "eps": "eps",
    "weight_decay": "weight_decay",
    "stochastic_rounding": "stochastic_rounding",
}


def _optimizer_name(value: Any) -> str:
    """``EmbOptimType.X`` or its value string -> recopt's optimizer name."""
    key = str(getattr(value, "value", value)).lower()
    if key not in EMB_OPTIM_TYPES:
        raise ValueError(
            f"fused_params['optimizer']={value!r} has no recopt fused kernel; use one of "
            f"EmbOptimType {sorted(EMB_OPTIM_TYPES)}"
        )
    return EMB_OPTIM_TYPES[key]


def fused_params_config(fused_params: Mapping[str, Any] | None) -> FusedOptimizerConfig | None:
    """The fused optimizer named by a sharder's ``fused_params`` (None when it names none).

    Raises:
        ValueError: an optimizer or a key recopt cannot honour (naming it and what is taken),
            or hyperparameters without an ``optimizer``.
    """
    params = dict(fused_params or {})
    optimizer = params.pop("optimizer", None)
    values: dict[str, Any] = {}
    betas = [params.pop("beta1", 0.9), params.pop("beta2", 0.999)]
    for key, value in params.items():
        if key not in _FIELDS:
            raise ValueError(
                f"fused_params[{key!r}]={value!r} has no recopt equivalent; recopt takes "
                f"'optimizer', 'beta1', 'beta2' and {sorted(_FIELDS)}"
            )
        values[_FIELDS[key]] = value
    if optimizer is None:
        if values:
            raise ValueError(
                f"fused_params {sorted(params)} set hyperparameters without an 'optimizer'; "
                "add 'optimizer': EmbOptimType.<...>"
            )
        return None
    name = _optimizer_name(optimizer)
    if name in ("adam", "row_wise_adam", "lamb", "row_wise_lamb"):
        values["betas"] = (float(betas[0]), float(betas[1]))
    return FusedOptimizerConfig(name=name, **{**FBGEMM_DEFAULTS, **values})
