import subprocess
import sys

import transformers

from chatd.model.kv_size import kv_size_table


def test_kv_size_prints_sizes_and_sessions_per_budget(smollm2_dir):
    result = subprocess.run([sys.executable, "-m", "chatd", "kv-size", "--model", str(smollm2_dir), "--tokens",
                             "512", "2048", "--dtype", "float16", "int8", "--budget-mb", "1024"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "30 layers, 3 KV heads (of 9), head_dim 64" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("float16"))
    # 23,040 bytes per token: 512 tokens are 11.25 MB, 2048 tokens 45 MB; 1024 MB hold 91 and 22 of them.
    assert row.split() == ["float16", "23,040", "11.2", "MB", "45.0", "MB", "91", "22"]
    # int8: 30 layers x 3 heads x (2 x 64 bytes + a 4-byte value scale) = 11,880 bytes per token.
    row = next(line for line in result.stdout.splitlines() if line.startswith("int8"))
    assert row.split() == ["int8", "11,880", "5.8", "MB", "23.2", "MB", "176", "44"]


def test_kv_size_says_what_sliding_windows_need(tmp_path):
    """Gemma 3 1B's shape: 26 layers, 22 of them sliding over 512 tokens, one KV head of 256."""
    config = transformers.Gemma3TextConfig(num_hidden_layers=26, sliding_window=512, num_key_value_heads=1,
                                           head_dim=256, num_attention_heads=4, sliding_window_pattern=6)
    config.save_pretrained(tmp_path)
    lines = kv_size_table(str(tmp_path), [512, 8192], ["bfloat16"], budget_mb=1024).splitlines()
    assert "26 layers (22 sliding, window 512 tokens), 1 KV heads (of 4), head_dim 256" in lines[0]
    # 2 x 26 x 256 x 2 bytes = 26,624 bytes per token; at 8192 tokens 208 MB, of which the windows need
    # 4 full layers x 8192 tokens + 22 sliding layers x 511 tokens: 43.0 MB.
    assert lines[2].split() == ["bfloat16", "26,624", "13.0", "MB", "208.0", "MB", "78", "4"]
    assert lines[3].split() == ["windows", "13.0", "MB", "43.0", "MB", "78", "23"]


def test_kv_size_shows_sessions_per_gb_with_a_shared_prompt_held_once(smollm2_dir):
    lines = kv_size_table(str(smollm2_dir), [300], ["float32", "int8"], None, shared_prompt=2000).splitlines()
    shared = lines.index(next(line for line in lines if "2000-token shared prompt" in line))
    row = next(line for line in lines[shared:] if line.startswith("float32"))
    # 46,080 bytes per token: 2,300 tokens each is 10 sessions per GB; the prompt once (88 MB), then 300 each: 71.
    assert row.split() == ["float32", "10", "->", "71"]
