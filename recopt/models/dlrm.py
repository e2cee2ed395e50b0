"""DLRM and its DCNv2 variant: dense MLP + embedding bags + feature interaction + top MLP.

Shapes: B batch, F sparse features, D embedding dim (= the bottom MLP's output width for the
dot interaction), N = F + 1 vectors per sample (the dense vector and one per sparse feature).
The embedding-bag collection is passed in, so the same model runs on a plain, fused or sharded one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recopt.models.mlp import FusedLinear, mlp
from recopt.sparse import KeyedJaggedTensor, KeyedTensor

INTERACTIONS = ("dot", "dcn")


@dataclass(frozen=True, kw_only=True, slots=True)
class DLRMConfig:
    """Architecture of the dense part of a DLRM / DCNv2 model.

    Args:
        dense_in_features: number of dense input columns (13 for Criteo).
        bottom_mlp: widths of the bottom MLP's layers; for ``dot`` the last one must equal
            the embedding dim.
        top_mlp: widths of the top MLP's hidden layers; a final layer to one logit is added.
        interaction: ``dot`` (DLRM pairwise dot products) or ``dcn`` (DCNv2 cross network).
        dcn_num_layers: number of cross layers (``dcn`` only).
        dcn_low_rank: rank r of each cross layer's ``U @ V.T`` factorisation, or 0 for the
            full-rank matrix (``dcn`` only).
        use_onednn: run the fp32 CPU matmuls of the MLPs and cross layers in oneDNN (see
            `recopt.models.mlp`); False uses ``nn.functional.linear`` everywhere.
    """

    dense_in_features: int = 13
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 32)
    interaction: str = "dot"
    dcn_num_layers: int = 2
    dcn_low_rank: int = 0
    use_onednn: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "bottom_mlp", tuple(self.bottom_mlp))
        object.__setattr__(self, "top_mlp", tuple(self.top_mlp))
        if self.interaction not in INTERACTIONS:
            raise ValueError(
                f"model.interaction {self.interaction!r} is unknown; use one of {INTERACTIONS}"
            )
        if self.dense_in_features < 1:
            raise ValueError(f"model.dense_in_features must be >= 1, got {self.dense_in_features}")
        if not self.bottom_mlp or min(self.bottom_mlp) < 1:
            raise ValueError(f"model.bottom_mlp needs positive widths, got {list(self.bottom_mlp)}")
        if self.top_mlp and min(self.top_mlp) < 1:
            raise ValueError(f"model.top_mlp needs positive widths, got {list(self.top_mlp)}")
        if self.dcn_num_layers < 0 or self.dcn_low_rank < 0:
            raise ValueError(
                f"model.dcn_num_layers ({self.dcn_num_layers}) and model.dcn_low_rank "
                f"({self.dcn_low_rank}) must be >= 0"
            )


class _UpperTriangleGram(torch.autograd.Function):
    """``bmm(x, x.T)``'s strict upper triangle, with a one-bmm backward.

    Autograd would differentiate ``bmm(x, x.T)`` as two bmms (one per operand) plus an add;
    the Gram matrix is symmetric, so ``grad_x = (G + G.T) @ x`` with G the incoming gradient
    scattered into the triangle. Small batched bmms are slow on CPU (per-matrix overhead),
    so one fewer is about a third of the interaction's time.
    """

    @staticmethod
    def forward(ctx: Any, vectors_B_N_D: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(vectors_B_N_D, flat_index)
        gram_B_N_N = torch.bmm(vectors_B_N_D, vectors_B_N_D.transpose(1, 2))
        return gram_B_N_N.flatten(1).index_select(1, flat_index)

    @staticmethod
    def backward(ctx: Any, grad_B_P: torch.Tensor) -> tuple[torch.Tensor, None]:
        vectors_B_N_D, flat_index = ctx.saved_tensors
        batch, num, _ = vectors_B_N_D.shape
        grad_B_N_N = grad_B_P.new_zeros(batch, num * num).index_copy_(1, flat_index, grad_B_P)
        grad_B_N_N = grad_B_N_N.view(batch, num, num)
        return torch.bmm(grad_B_N_N + grad_B_N_N.transpose(1, 2), vectors_B_N_D), None


class DotInteraction(nn.Module):
    """Pairwise dot products of N vectors: the strict upper triangle of ``T @ T.T``.

    Input ``[B, N, D]``; output ``[B, N*(N-1)/2]``, pairs ordered row by row
    ((0,1), (0,2), ..., (1,2), ...).
    """

    flat_index: torch.Tensor

    def __init__(self, num_vectors: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        # One flat gather index into the [N*N] products beats two-level advanced indexing.
        self.register_buffer("flat_index", rows * num_vectors + cols, persistent=False)
        self.num_vectors = num_vectors

    @property
    def num_outputs(self) -> int:
        """Number of pairs, N*(N-1)/2."""
        return self.num_vectors * (self.num_vectors - 1) // 2

    def forward(self, vectors_B_N_D: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = _UpperTriangleGram.apply(vectors_B_N_D, self.flat_index)
        return result


class CrossNetwork(nn.Module):
    """DCNv2 cross layers: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l``, W full or ``U_l V_l^T``.

    Args:
        width: size of x.
        num_layers: number of cross layers.
        low_rank: 0 for full-rank ``W_l``, else the rank r of ``U_l V_l^T``.
    """

    def __init__(
        self, width: int, num_layers: int, low_rank: int = 0, use_onednn: bool = True
    ) -> None:
        super().__init__()
        if low_rank:
            self.down = nn.ModuleList(
                FusedLinear(width, low_rank, bias=False, use_onednn=use_onednn)
                for _ in range(num_layers)
            )
            self.up = nn.ModuleList(
                FusedLinear(low_rank, width, use_onednn=use_onednn) for _ in range(num_layers)
            )
        else:
            self.down = nn.ModuleList()
            self.up = nn.ModuleList(
                FusedLinear(width, width, use_onednn=use_onednn) for _ in range(num_layers)
            )

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer, up in enumerate(self.up):
            projected = up(self.down[layer](x)) if len(self.down) else up(x)
            x = torch.addcmul(x, x0, projected)
        return x


def _feature_dims(embedding_bags: nn.Module) -> list[tuple[str, int]]:
    """(feature name, embedding dim) of every feature, in the KeyedTensor's column order."""
    tables = getattr(embedding_bags, "tables", None)
    if tables is None:
        raise ValueError(
            f"{type(embedding_bags).__name__} has no `tables` attribute; pass an "
            "EmbeddingBagCollection (plain, fused or sharded) or give feature_dims explicitly"
        )
    return [(name, t.embedding_dim) for t in tables for name in t.feature_names]


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019) with the dot interaction, or DCNv2 (Wang et al. 2020).

    ``forward(dense [B, dense_in_features], sparse KJT) -> logits [B]``. The bottom MLP maps
    the dense features to a vector; ``dot`` concatenates that vector with the pairwise dot
    products of it and the F pooled embeddings; ``dcn`` runs the cross network over the
    concatenation of the vector and the embeddings. The top MLP maps the result to one logit.

    Example: 26 features of dim 16, ``bottom_mlp=(64, 16)``, ``dot``: the top MLP's input is
    16 + 27*26/2 = 367 wide.

    Args:
        embedding_bags: KJT -> KeyedTensor module (EmbeddingBagCollection, fused or sharded).
        config: the architecture.
        feature_dims: (feature, dim) in the KeyedTensor's column order; read from
            ``embedding_bags.tables`` when None.

    Raises:
        ValueError: for ``dot`` if an embedding dim differs from ``bottom_mlp[-1]``.
    """

    def __init__(
        self,
        embedding_bags: nn.Module,
        config: DLRMConfig,
        feature_dims: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        super().__init__()
        dims = list(feature_dims) if feature_dims is not None else _feature_dims(embedding_bags)
        if not dims:
            raise ValueError("DLRM needs at least one sparse feature")
        self.config = config
        self.feature_names = [name for name, _ in dims]
        self.embedding_bags = embedding_bags
        dense_dim = config.bottom_mlp[-1]
        onednn = config.use_onednn
        self.bottom_mlp = mlp(config.dense_in_features, config.bottom_mlp, use_onednn=onednn)
        if config.interaction == "dot":
            for name, dim in dims:
                if dim != dense_dim:
                    raise ValueError(
                        f"feature {name!r}: embedding_dim {dim} differs from the bottom MLP's "
                        f"output width {dense_dim} (model.bottom_mlp[-1]); the dot interaction "
                        f"needs them equal: set model.bottom_mlp[-1] = {dim}"
                    )
            self.interaction: nn.Module = DotInteraction(len(dims) + 1)
            top_in = dense_dim + self.interaction.num_outputs
        else:
            top_in = dense_dim + sum(dim for _, dim in dims)
            self.interaction = CrossNetwork(
                top_in, config.dcn_num_layers, config.dcn_low_rank, use_onednn=onednn
            )
        # The hidden layers with ReLU, then one more layer to the logit.
        self.top_mlp = mlp(top_in, [*config.top_mlp, 1], final_relu=False, use_onednn=onednn)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        dense_B_D = self.bottom_mlp(dense)
        pooled = self.embedding_bags(sparse)
        pooled_B_FD = _in_order(pooled, self.feature_names)
        if self.config.interaction == "dot":
            batch, dim = dense_B_D.shape
            # The vector count is explicit: an empty batch (B = 0) has no size to infer it from.
            num_vectors = 1 + pooled_B_FD.shape[1] // dim
            vectors_B_N_D = torch.cat([dense_B_D, pooled_B_FD], dim=1).view(batch, num_vectors, dim)
            top_in = torch.cat([dense_B_D, self.interaction(vectors_B_N_D)], dim=1)
        else:
            top_in = self.interaction(torch.cat([dense_B_D, pooled_B_FD], dim=1))
        return self.top_mlp(top_in).squeeze(1)


def _in_order(pooled: KeyedTensor, feature_names: list[str]) -> torch.Tensor:
    """The pooled embeddings [B, sum D] in the model's feature order (no copy if already so)."""
    if pooled.keys() == feature_names:
        return pooled.values()
    return KeyedTensor.regroup([pooled], [feature_names])[0]
