"""The `chatd` command and what it drives from outside a server: the client, the terminal chat and the bench."""
