"""Models chatd cannot serve exactly are refused at start with one line naming the reason; the families it
serves pass."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers

from chatd.model.loader import check_model
from chatd.model.servable import Unservable, attention_implementation, check_servable
from tests.families import FAMILIES, family_config

REFUSED = {  # a config transformers builds here -> what the refusal must say
    "t5": (lambda: transformers.T5Config(d_model=32, num_layers=1), "encoder-decoder"),
    "mamba": (lambda: transformers.MambaConfig(hidden_size=32, num_hidden_layers=2), "recurrent state"),
    "jamba": (lambda: transformers.JambaConfig(hidden_size=32, num_hidden_layers=4), "recurrent state"),
    "qwen3_next": (lambda: transformers.Qwen3NextConfig(hidden_size=32, num_hidden_layers=4), "recurrent state"),
    "falcon_h1": (lambda: transformers.FalconH1Config(hidden_size=32, num_hidden_layers=2), "mixes attention"),
    "rwkv": (lambda: transformers.RwkvConfig(hidden_size=32, num_hidden_layers=2), "attention interface"),
    "llama4": (lambda: transformers.Llama4TextConfig(hidden_size=32, num_hidden_layers=4), "chunks"),
    "llava": (lambda: transformers.LlavaConfig(), "multimodal"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_a_model_chatd_cannot_serve_is_refused_from_its_config(kind, tmp_path):
    make, reason = REFUSED[kind]
    make().save_pretrained(tmp_path)
    with pytest.raises(Unservable, match=reason):
        check_model(str(tmp_path))


def test_a_model_that_needs_remote_code_is_refused_without_running_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "northwind_lm", "auto_map": {"AutoConfig": "configuration_northwind.NorthwindConfig",
                                                   "AutoModelForCausalLM": "modeling_northwind.NorthwindLM"}}))
    (tmp_path / "configuration_northwind.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(Unservable, match="remote code"):
        check_model(str(tmp_path))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_tested_family_is_served(family):
    config = family_config(family, vocab_size=100, bos=1, eos=2)
    check_servable(config)
    assert attention_implementation(config) == ("eager" if family == "gemma2" else None)


def test_chatd_serve_refuses_in_one_line_with_exit_2(tmp_path):
    transformers.MambaConfig(hidden_size=32, num_hidden_layers=2).save_pretrained(tmp_path)
    done = subprocess.run([sys.executable, "-m", "chatd", "serve", "--model", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"chatd serve: model '{tmp_path}' cannot be served: ") and "Mamba" in lines[0]
