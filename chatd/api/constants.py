"""What every API of the server shares: the caps a request may ask for, the rule for a function's name, the
headers that name a conversation's session and the worker that answered, and this worker's name."""

from __future__ import annotations

import os
import socket

MAX_NEW_TOKENS_CAP = 4096  # the most new tokens any request may ask for, whatever --max-new-tokens says
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # a tool's name, as OpenAI and Anthropic allow it
SESSION_HEADER = "X-Chatd-Session-Id"  # a client or gateway pins later requests with it (as X-Session-Id)
WORKER_HEADER = "X-Chatd-Worker"  # host:pid of the worker that answered
WORKER = f"{socket.gethostname()}:{os.getpid()}"
ARGUMENTS_FRAGMENT = 32  # characters of a call's arguments per streamed chunk
