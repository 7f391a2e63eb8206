"""chatd: a chat backend that keeps every conversation's KV cache alive between turns."""
