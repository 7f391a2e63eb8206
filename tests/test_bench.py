"""`chatd bench` as a user runs it: two real servers, simulated customers, a report, JSON and a plot."""

import json
import subprocess
import sys


def test_bench_compares_two_configurations(tiny_checkpoint, tmp_path):
    output = tmp_path / "result.json"
    model = f"--model {tiny_checkpoint} --device cpu"
    run = subprocess.run(
        [sys.executable, "-m", "chatd", "bench", "--compare", f"--a={model}", f"--b={model} --no-session-cache",
         "--customers", "3", "--turns", "3", "--think-s", "0.05", "--max-new-tokens", "4", "--rounds", "2",
         "--output", str(output)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "TTFT p50, turns 3+ (ms)" in run.stdout and "A/B" in run.stdout
    assert f"B: {model} --no-session-cache" in run.stdout
    result = json.loads(output.read_text())
    cached, uncached = result["results"]
    for config in (cached, uncached):
        assert len(config["samples"]) == 3 * 3 * 2 and config["errors"] == {}
        assert sorted(config["ttft_ms_by_turn"]) == ["1", "2", "3"]
        assert config["tokens_per_s"] > 0 and config["inter_token_ms"]["p50"] > 0
    assert cached["cache_sources"].get("device", 0) >= 3 * 2 * 2, "turns 2 and 3 of every customer"
    assert set(uncached["cache_sources"]) == {"miss"}
    assert output.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plays_stateless_openai_clients(tiny_checkpoint, tmp_path):
    output = tmp_path / "openai.json"
    run = subprocess.run(
        [sys.executable, "-m", "chatd", "bench", "--api", "openai", f"--serve=--model {tiny_checkpoint} --device cpu",
         "--customers", "2", "--turns", "3", "--think-s", "0.05", "--max-new-tokens", "4", "--output", str(output)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (result,) = json.loads(output.read_text())["results"]
    assert len(result["samples"]) == 2 * 3 and result["errors"] == {}
    assert result["cache_sources"] == {"miss": 2, "cached": 4}  # each resent history found its session's cache
    assert result["tokens_per_s"] > 0


def test_gpu_check_runs_every_path_on_the_cpu(tiny_checkpoint, tmp_path):
    """bench/gpu_check.py is for a CUDA machine; on the CPU the same code runs, so that it cannot rot."""
    run = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--model", str(tiny_checkpoint), "--tokens", "64",
         "--batches", "1", "2", "--output", str(tmp_path / "gpu_check.json")], capture_output=True, text=True,
        timeout=300)
    assert run.returncode == 0, run.stderr
    assert "bytes equal: True" in run.stdout and "greedy tokens equal" in run.stdout
    assert "decode, batch 2" in run.stdout and "out-of-memory retry" in run.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["device"].startswith("cpu")
