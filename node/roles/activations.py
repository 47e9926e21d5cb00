"""What travels between stage servers, expert hosts and trainers: activations, their gradients and
token ids; the codec they travel with, and the checks on what a peer sent before it is used."""

from __future__ import annotations

import torch

from protocol import RemoteProtocolError, decode_tensor, make_codec
from protocol.tensors import EncodedTensor

from ..runconfig import RunConfig

MAX_ABS = 1e6  # |activation| or |gradient| beyond this is refused as garbage
TOKENS = make_codec("none")  # token ids and targets travel exactly


def activation_codec(run: RunConfig, n_embd: int):
    """The codec activations and their gradients travel with. int8 gets one scale per token's
    vector (a block of n_embd values): the residual stream's magnitude varies by token."""
    if run.activation_codec == "int8":
        return make_codec("int8", block_size=max(16, n_embd))
    return make_codec(run.activation_codec)


def encode_floats(codec, t: torch.Tensor) -> EncodedTensor:
    return codec.encode(t.detach().to(torch.float32))


def decode_checked(enc: EncodedTensor, max_numel: int, what: str) -> torch.Tensor:
    """A tensor a peer sent, decoded; RemoteProtocolError naming `what` if it is malformed or
    holds NaN, Inf or absurd values."""
    try:
        return decode_tensor(enc, max_numel=max_numel, max_abs=MAX_ABS)
    except RemoteProtocolError as e:
        raise RemoteProtocolError(f"{what}: {e}") from None
