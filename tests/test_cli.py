"""`chatd serve` as a user runs it: a real process, a real port, a clean shutdown on SIGTERM."""

import asyncio
import os
import re
import signal
import subprocess
import sys

import pytest

from chatd.cli.client import ChatClient
from chatd.config import Settings


def chatd(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "chatd", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def test_serve_a_local_checkpoint_chat_and_stop_on_sigterm(tiny_checkpoint, tmp_path):
    (tmp_path / "keys").write_text("# the support widget\nsk-cli-test\n")
    server = chatd("serve", "--model", str(tiny_checkpoint), "--port", "0", "--device", "cpu",
                   "--api-key-file", str(tmp_path / "keys"))
    try:
        line = await asyncio.wait_for(asyncio.to_thread(server.stdout.readline), 120)
        url = re.search(r"ws://\S+/ws", line)
        assert url, f"no listening line, got {line!r}"
        assert "cpu" in line and "float32" in line
        cores = len(os.sched_getaffinity(0))  # the default --threads: the cores this process may use
        assert re.search(rf"\b{cores} threads?\)", line), line
        async with await ChatClient.connect(url.group(0), api_key="sk-cli-test") as client:
            session_id = (await client.open_session(system="Be brief.")).session_id
            done = await (await client.chat(session_id, "Hello", max_new_tokens=5)).result()
            assert done.usage.completion_tokens == 5
        command = [sys.executable, "-m", "chatd", "chat", "--url", url.group(0), "--max-new-tokens", "4"]
        refused = subprocess.run(command, input="Hi\n", capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "chatd chat: unauthorized" in refused.stderr
        terminal = subprocess.run(command, input="Hi there\nAnd again\n", capture_output=True, text=True,
                                  timeout=60, env={**os.environ, "CHATD_CLIENT_API_KEY": "sk-cli-test"})
        assert terminal.returncode == 0, terminal.stderr
        assert terminal.stdout.count("bot> ") == 2
        summaries = re.findall(r"\[(\w+)[^,]*, cached (\d+)/(\d+) prompt tokens, TTFT \d+ ms", terminal.stderr)
        assert [source for source, _, _ in summaries] == ["miss", "device"]
        assert int(summaries[1][1]) > 0
    finally:
        server.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(server.wait, 30) == 0


def test_threads_sets_the_model_threads(tiny_checkpoint):
    """--threads overrides the default (the cores the process may use, checked by the serve test above)."""
    server = chatd("serve", "--model", str(tiny_checkpoint), "--port", "0", "--device", "cpu", "--threads", "1")
    try:
        line = server.stdout.readline()
        assert re.search(r"\b1 thread\)", line), line
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0


def test_a_model_that_cannot_load_is_a_clear_error(tmp_path):
    server = chatd("serve", "--model", str(tmp_path / "missing-model"), "--port", "0")
    _, stderr = server.communicate(timeout=120)
    assert server.returncode == 1
    assert "chatd: loading model" in stderr and "missing-model" in stderr


def test_bad_flags_are_named():
    server = chatd("serve", "--dtype", "float8", "--port", "0")
    _, stderr = server.communicate(timeout=60)
    assert server.returncode == 2 and "--dtype" in stderr


def test_serve_help_names_every_setting_at_once():
    """Every setting's flag and description (a description with a % in it too), answered before torch loads."""
    process = subprocess.run([sys.executable, "-X", "importtime", "-m", "chatd", "serve", "--help"],
                             capture_output=True, text=True, timeout=60)
    assert process.returncode == 0, process.stderr
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in process.stdout
    assert "1% of the host's memory" in " ".join(process.stdout.split())
    assert not re.search(r"\| torch$", process.stderr, re.MULTILINE), "torch was imported"


LIST_SETTINGS = [name for name, field in Settings.model_fields.items() if field.annotation == list[str]]
FILE_LISTS = {"warm_prompt"}  # lists of files, which must exist


def test_every_list_setting_is_found():
    assert set(LIST_SETTINGS) == {"api_key", "allowed_origins", *FILE_LISTS}


def test_warm_prompts_are_files_read_without_their_final_newline(tmp_path, monkeypatch):
    first, second = tmp_path / "policy.txt", tmp_path / "faq.txt"
    first.write_text("You are Northwind's agent.\n")
    second.write_text("Answer from the FAQ.")
    monkeypatch.setenv("CHATD_WARM_PROMPT", f"{first},{second}")
    assert Settings().warm_prompts() == ["You are Northwind's agent.", "Answer from the FAQ."]
    process = subprocess.run([sys.executable, "-m", "chatd", "serve", "--port", "0", "--warm-prompt",
                              str(tmp_path / "missing.txt")], capture_output=True, text=True, timeout=60)
    lines = process.stderr.strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1 and "--warm-prompt" in lines[0] and "missing.txt" in lines[0]


@pytest.mark.parametrize("name", sorted(set(LIST_SETTINGS) - FILE_LISTS))
@pytest.mark.parametrize(("text", "expected"), [
    ("https://one.example", ["https://one.example"]),
    (" https://one.example, https://two.example ,", ["https://one.example", "https://two.example"]),
    ('["https://one.example", "with,comma"]', ["https://one.example", "with,comma"]),
])
def test_every_list_setting_reads_one_value_commas_or_json_from_the_environment(name, text, expected, monkeypatch):
    monkeypatch.setenv(f"CHATD_{name.upper()}", text)
    assert getattr(Settings(), name) == expected


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("CHATD_API_KEY", '["unclosed', "not a JSON list"),
    ("CHATD_ALLOWED_ORIGINS", "[1, 2]", "strings only"),
    ("CHATD_MAX_BATCH", "eighty", "valid integer"),
])
def test_a_bad_environment_value_is_one_line_naming_the_variable(variable, value, says):
    process = subprocess.run([sys.executable, "-m", "chatd", "serve", "--port", "0"], capture_output=True, text=True,
                             env={**os.environ, variable: value}, timeout=60)
    assert process.returncode == 2
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1 and variable in lines[0] and says in lines[0], process.stderr
    assert "Traceback" not in process.stderr
