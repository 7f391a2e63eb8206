import subprocess
import sys


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
