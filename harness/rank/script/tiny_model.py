"""``python -m harness watch --tiny-model`` (harness/rank/script/run.py): a script's pretrained transformers
models built of their own configs shrunk, with random weights; the sync is checked the same on a model
of two layers as on the checkpoint's, in a fraction of the time."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Iterator

from harness.rank.watch import LoopRefused

# ``--tiny-model``: a pretrained transformers model's config shrunk to these sizes, where it has them
TINY_SIZES = {
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "hidden_size": 32, "n_embd": 32, "d_model": 32,
    "num_attention_heads": 2, "n_head": 2, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "d_ff": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
}


def tiny_config(config: Any) -> Any:
    """A copy of a transformers config with ``TINY_SIZES`` where it has those sizes (key-value heads
    no more than the heads, a head's width what the width and heads make)."""
    small = copy.deepcopy(config)
    for key, size in TINY_SIZES.items():
        if isinstance(getattr(small, key, None), int):
            setattr(small, key, size)
    if isinstance(getattr(small, "num_key_value_heads", None), int):
        small.num_key_value_heads = min(small.num_key_value_heads, 2)
    if isinstance(getattr(small, "head_dim", None), int):
        small.head_dim = 16
    return small


@contextlib.contextmanager
def tiny_pretrained(forced: dict[str, str]) -> Iterator[None]:
    """Every ``from_pretrained`` of a transformers model builds it of its own config shrunk
    (``tiny_config``), with random weights: the checkpoint's config is read (a local directory, the
    cache, or the hub), its weights are not. Each one is said in ``forced`` (a cell's: its summary
    says it)."""
    try:
        from transformers import AutoConfig, PreTrainedModel
    except ImportError:
        raise LoopRefused("watch: --tiny-model shrinks transformers models; transformers is not installed") from None
    original = vars(PreTrainedModel)["from_pretrained"]

    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.pop("config", None)
        dtype = kwargs.pop("torch_dtype", None) or kwargs.pop("dtype", None)
        if config is None or isinstance(config, (str, os.PathLike)):
            config, kwargs = AutoConfig.from_pretrained(config or name, return_unused_kwargs=True, **kwargs)
        else:
            for key in [k for k in kwargs if hasattr(config, k)]:
                setattr(config, key, kwargs.pop(key))
        small = tiny_config(config)
        model = cls._from_config(small, **({"torch_dtype": dtype} if dtype is not None else {}))
        forced[f"model {name}"] = f"pretrained -> tiny ({small.model_type}: 2 layers, width 32, random weights)"
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[assignment]
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original  # type: ignore[assignment]
