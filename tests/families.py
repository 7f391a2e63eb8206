"""Tiny random-weight models of the decoder families users deploy, built from each family's own config,
and transformers' `generate` as the reference they are compared with.

Every model uses the real SmolLM2 tokenizer (so chatd renders real chat prompts), float64 weights, a
sliding window much shorter than the test conversations where the family has one, and an output
projection scaled up so that logits are peaked: float reordering between two correct attention paths
cannot flip a greedy choice, while a layer that sees the wrong tokens changes the reply at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PretrainedConfig

from cache_store.host.quantize import dequantize, quantize
from chatd.model.loader import LoadedModel, stop_token_ids
from chatd.model.servable import attention_implementation

WINDOW = 12  # tokens a sliding-window layer sees: far fewer than any test conversation
CONTEXT = 1024
LOGIT_SCALE = 25.0

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
               initializer_range=0.2)
_SLIDING_EVERY_OTHER = ["sliding_attention", "full_attention"] * 2


def _config(class_name: str, **settings) -> Callable[[dict], PretrainedConfig]:
    return lambda common: getattr(transformers, class_name)(**{**common, **settings})


def _gemma3_multimodal(common: dict) -> PretrainedConfig:
    """Gemma 3 as its 4B-27B checkpoints ship: the text model inside a vision-language config (served as text)."""
    vocab = common["vocab_size"]
    text = {**common, "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)


# family -> its config. Windows on the families that have them, in the way each family's config spells them:
# `sliding_window` alone (Mistral, Phi-3: every layer), `use_sliding_window` with `max_window_layers` (Qwen2,
# Qwen3), or `layer_types` (Gemma 2 and 3, Cohere 2, gpt-oss, SmolLM3).
FAMILIES: dict[str, Callable[[dict], PretrainedConfig]] = {
    "llama": _config("LlamaConfig"),
    "qwen2": _config("Qwen2Config", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": _config("Qwen3Config", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "mistral": _config("MistralConfig", sliding_window=WINDOW),
    "gemma2": _config("Gemma2Config", sliding_window=WINDOW, layer_types=_SLIDING_EVERY_OTHER, query_pre_attn_scalar=16,
                      attn_logit_softcapping=20.0, final_logit_softcapping=300.0),
    "gemma3": _config("Gemma3TextConfig", sliding_window=WINDOW, query_pre_attn_scalar=16,
                      layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "gemma3_multimodal": _gemma3_multimodal,
    "phi3": _config("Phi3Config", sliding_window=WINDOW, pad_token_id=0),
    "olmo2": _config("Olmo2Config"),
    "granite": _config("GraniteConfig", embedding_multiplier=4.0, residual_multiplier=0.5, logits_scaling=0.5,
                       attention_multiplier=0.25),
    "cohere2": _config("Cohere2Config", sliding_window=WINDOW, logit_scale=1.0,
                       layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "smollm3": _config("SmolLM3Config", pad_token_id=None, use_sliding_window=True, sliding_window=WINDOW,
                       layer_types=_SLIDING_EVERY_OTHER, no_rope_layers=[1, 1, 1, 0]),
    "gpt_oss": _config("GptOssConfig", sliding_window=WINDOW, layer_types=_SLIDING_EVERY_OTHER, num_local_experts=4,
                       num_experts_per_tok=2),
}


def family_config(family: str, vocab_size: int, bos: int | None, eos: int | None) -> PretrainedConfig:
    """The family's config with tiny sizes and the settings above."""
    return FAMILIES[family]({**_COMMON, "vocab_size": vocab_size, "bos_token_id": bos, "eos_token_id": eos})


def family_model(family: str, tokenizer_dir) -> LoadedModel:
    """A tiny random model of `family` with the SmolLM2 tokenizer, its attention chosen as chatd's loader
    chooses it for any checkpoint."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = family_config(family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(0)
    # grouped_mm (the default experts kernel of MoE families) takes no float64: the eager loop does
    extra = {"experts_implementation": "eager"} if family == "gpt_oss" else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64,
                                             attn_implementation=attention_implementation(config), **extra).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    return LoadedModel(name=f"tiny-{family}", model=model, tokenizer=tokenizer, device=torch.device("cpu"),
                       stop_token_ids=stop_token_ids(tokenizer, model))


def reference_reply(loaded: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int,
                    cache: DynamicCache | None = None) -> list[int]:
    """What transformers generates greedily for `prompt_ids` (recomputing the whole prompt, or continuing
    from `cache`, which it extends), without the stop token (chatd does not report it)."""
    with torch.inference_mode():
        output = loaded.model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens,
                                       do_sample=False, eos_token_id=sorted(loaded.stop_token_ids),
                                       pad_token_id=loaded.tokenizer.pad_token_id or 0, cache=cache)
    reply = output[0, len(prompt_ids):].tolist()
    return reply[:-1] if reply and reply[-1] in loaded.stop_token_ids else reply


class Int8Reference:
    """transformers continuing a conversation from the same int8 copies of its keys and values that the host
    tier keeps (`--host-kv-dtype int8`): before each turn the cache is quantised and dequantised exactly as
    an offload and a restore do, cropped to what the prompt reuses, and `generate` continues from it.

    int8 is lossy: on a random-weight model its error is of the size of the gaps between the top logits,
    so a reply recomputed from scratch may differ from one continued from the int8 copy. What must be exact
    is everything else on that path, each layer's window included; that is what this reference checks."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.cache: DynamicCache | None = None  # every layer keeps every token, as the arena does
        self.kept = 0  # positions a host copy kept from the last restore holds (0: none)

    def reply(self, prompt_ids: Sequence[int], cached_tokens: int, max_new_tokens: int, exact: int = 0) -> list[int]:
        """`exact`: the leading positions held by a shared segment, which the host tier keeps exact (it is held
        once); the session's own positions after them are quantised on their own, each only once: an offload
        continues the host copy its cache was restored from (quantising only the positions after it) unless the
        turn recomputed some of that copy's positions."""
        cache = DynamicCache()
        if self.cache is not None and cached_tokens:
            start = self.kept or exact
            layers = [(layer.keys[:, :, start:], layer.values[:, :, start:]) for layer in self.cache.layers]
            quantized, scales = quantize(layers)
            for index, (keys, values) in enumerate(dequantize(quantized, scales, self.loaded.model.dtype)):
                layer = self.cache.layers[index]
                keys = torch.cat([layer.keys[:, :, :start], keys], dim=2)
                values = torch.cat([layer.values[:, :, :start], values], dim=2)
                cache.update(keys[:, :, :cached_tokens], values[:, :, :cached_tokens], index)
            length = self.cache.get_seq_length()
            self.kept = length if cached_tokens >= length else 0
        reply = reference_reply(self.loaded, prompt_ids, max_new_tokens, cache)
        self.cache = cache
        return reply


Builder = Callable[[str], LoadedModel]
