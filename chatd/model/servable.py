"""Which checkpoints chatd can serve exactly, decided from the config before any weight is read.

chatd serves decoder-only causal language models whose every layer keeps a KV cache (full or sliding-window
attention) and runs its attention through transformers' attention interface, which the KV arena plugs into.
Anything else is refused at start with one line naming the reason, never served approximately.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.models.auto import modeling_auto

SERVED_LAYER_TYPES = {"full_attention", "sliding_attention"}
_LAYER_TYPE_REASONS = {
    "linear_attention": "keeps a recurrent state (Mamba, linear attention), not a KV cache",
    "hybrid": "mixes attention with a recurrent state (Mamba) in one layer, which is not a KV cache",
    "conv": "keeps a convolution state, not a KV cache",
    "chunked_attention": "attends in chunks (Llama 4), which the KV arena does not implement",
    "dummy": "shares another layer's KV cache, or has no attention at all",
}
_MULTIMODAL_MAPPINGS = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
                        "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES")


class Unservable(ValueError):
    """A model chatd cannot serve exactly; the message is the reason, in one line."""


def read_config(source: str | Path) -> PretrainedConfig:
    """The checkpoint's config, never running code that ships with it (a checkpoint that needs it is
    refused: chatd runs only transformers' own, audited, model code)."""
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=False)
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise Unservable("it needs remote code (trust_remote_code): chatd runs only the model code that "
                             "ships with transformers") from None
        raise


def check_servable(config: PretrainedConfig) -> None:
    """Raise `Unservable` unless chatd can serve a model of this config exactly."""
    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise Unservable(f"it is an encoder-decoder model ({model_type}); chatd serves decoder-only causal LMs")
    if model_type not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if any(model_type in getattr(modeling_auto, name, {}) for name in _MULTIMODAL_MAPPINGS):
            raise Unservable(f"it is a multimodal checkpoint ({model_type}) with no text-only causal LM in "
                             f"transformers; chatd serves text chat")
        raise Unservable(f"transformers has no causal language model for model type {model_type!r}")
    text = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text)
    for kind in layer_types:
        if kind not in SERVED_LAYER_TYPES:
            raise Unservable(f"its {kind!r} layers: a layer that "
                             f"{_LAYER_TYPE_REASONS.get(kind, 'chatd does not know how to cache')}")
    model_class = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not getattr(model_class, "_supports_attention_backend", False):
        raise Unservable(f"{model_class.__name__} does not run its attention through transformers' attention "
                         f"interface, which chatd's KV arena plugs into (or keeps no KV cache at all)")


def attention_implementation(config: PretrainedConfig) -> str | None:
    """"eager" where sdpa cannot compute the model's attention (logit soft-capping, as in Gemma 2 and
    optionally Gemma 3); None lets transformers choose (sdpa where the family supports it, else eager)."""
    text = config.get_text_config(decoder=True)
    return "eager" if getattr(text, "attn_logit_softcapping", None) is not None else None
